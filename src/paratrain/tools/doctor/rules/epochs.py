"""``set_epoch(x)`` of an ``x`` that is the same every epoch: the sampler seeds its shuffle
with it, so every epoch repeats the first one's order."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor.names import DISTRIBUTED_SAMPLER, dotted
from paratrain.tools.doctor.rules.base import Hit
from paratrain.tools.doctor.script import Script, keyword, own_nodes

#: calls that may change any attribute of an object (``setattr(args, "epochs", e)``)
_ANY_ATTRIBUTE = {"setattr", "vars"}


def fixed_epoch(script: Script) -> Iterator[Hit]:
    """``sampler.set_epoch(0)``, ``set_epoch(x)`` of an ``x`` that never changes, or
    ``set_epoch(x)`` in an epoch loop that never changes ``x`` (``for i in
    range(num_epochs): sampler.set_epoch(num_epochs)``)."""
    for call in script.method_calls("set_epoch"):
        if len(call.args) != 1 or call.keywords:
            continue
        arg = call.args[0]
        if _never_changes(script, call, arg) or _same_each_pass(script, call, arg):
            yield Hit(
                call,
                f"set_epoch({ast.unparse(arg)}) is given the same value every epoch: the "
                "sampler repeats the same shuffle",
                "pass the epoch: for epoch in range(epochs): sampler.set_epoch(epoch)",
            )


def _never_changes(script: Script, call: ast.Call, arg: ast.expr) -> bool:
    """A constant, or a name only ever assigned constants outside loops (not for a sampler
    that does not shuffle, nor, outside a loop, where the project also calls set_epoch with
    a value that may change: ``set_epoch(0)`` at construction, the epoch in the loop)."""
    if _unshuffled(script, call.func) or (
        not script.loops_around(call) and _set_elsewhere(script, call)
    ):
        return False
    if isinstance(arg, ast.Constant):
        return True
    if not isinstance(arg, ast.Name):
        return False
    params = getattr(script.scope(call), "args", None)
    if params is not None and arg.id in {a.arg for a in [*params.args, *params.kwonlyargs]}:
        return False  # a parameter: each call may pass another epoch
    values = script.assigned.get(arg.id, [])
    changes = any(not isinstance(v, ast.Constant) or script.loops_around(s) for v, s in values)
    return bool(values) and not (
        changes or _loop_target(script, arg.id) or _rebound_elsewhere(script, arg.id)
    )


def _unshuffled(script: Script, func: ast.expr) -> bool:
    """``x.set_epoch`` of an ``x = DistributedSampler(..., shuffle=False)``: its order never
    depends on the epoch."""
    name = dotted(func.value) if isinstance(func, ast.Attribute) else None
    for value, _ in script.assigned.get(name or "", []):
        if isinstance(value, ast.Call) and script.full_name(value.func) == DISTRIBUTED_SAMPLER:
            shuffle = keyword(value, "shuffle", 3)
            if isinstance(shuffle, ast.Constant) and shuffle.value is False:
                return True
    return False


def _set_elsewhere(script: Script, call: ast.Call) -> bool:
    """Whether the project calls set_epoch elsewhere with an argument that is not a
    constant."""
    if "varying_set_epoch" not in script.memo:
        script.memo["varying_set_epoch"] = [
            other
            for module in script.modules
            for other in module.method_calls("set_epoch")
            if not (len(other.args) == 1 and isinstance(other.args[0], ast.Constant))
        ][:2]  # two are enough to know whether one is not ``call``
    varying: list[ast.Call] = script.memo["varying_set_epoch"]
    return any(other is not call for other in varying)


def _same_each_pass(script: Script, call: ast.Call, arg: ast.expr) -> bool:
    """``set_epoch(x)`` inside a loop of its function where neither ``x`` nor the sampler it
    is called on can change from one pass to the next: nothing in the loop stores to them
    (nor calls ``setattr``), and nothing else can (no ``global``/``nonlocal`` for a name; for
    an attribute, no store to it outside ``__init__`` anywhere in the project)."""
    name = dotted(arg)
    loops = script.loops_around(call)
    if name is None or not loops or not isinstance(call.func, ast.Attribute):
        return False
    outer = loops[-1]  # every loop around it must keep x: the outermost holds them all
    stored, touched = _stored(outer)
    receiver = {n.id for n in ast.walk(call.func.value) if isinstance(n, ast.Name)}
    receiver |= _prefixes(dotted(call.func.value) or "")
    parts = name.split(".")
    if touched & _ANY_ATTRIBUTE or _prefixes(name) & stored or receiver & stored:
        return False
    if isinstance(arg, ast.Name):
        return not _rebound_elsewhere(script, name)
    if parts[0] in touched:
        return False  # a method of the object called in the loop (cfg.merge_from_list)
    return not _attribute_stored(script, call, outer, parts[-1])


def _prefixes(name: str) -> set[str]:
    """``a``, ``a.b``, ``a.b.c`` for ``a.b.c``."""
    parts = name.split(".") if name else []
    return {".".join(parts[: i + 1]) for i in range(len(parts))}


def _stored(loop: ast.AST) -> tuple[set[str], set[str]]:
    """(the names and dotted names ``loop``'s own code stores to, the names it calls or calls
    methods of)."""
    stored: set[str] = set()
    touched: set[str] = set()
    for node in [loop, *own_nodes(loop)]:
        for target in _targets(node):
            for leaf in _leaves(target):
                if (whole := dotted(leaf)) is not None:
                    stored.add(whole)
                elif isinstance(leaf, ast.Subscript) and (base := dotted(leaf.value)):
                    stored.add(base)  # cfg["epochs"] = ... changes cfg
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                touched.add(func.id)
            elif isinstance(func, ast.Attribute) and (base := dotted(func.value)):
                touched.add(base.split(".")[0])
        elif isinstance(node, ast.Attribute) and node.attr == "__dict__":
            touched.add("vars")
    return stored, touched


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
        return [node.target]
    if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        return [node.target]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [node.optional_vars]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _leaves(target: ast.expr) -> Iterator[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _leaves(element)
    elif isinstance(target, ast.Starred):
        yield from _leaves(target.value)
    else:
        yield target


def _attribute_stored(script: Script, call: ast.Call, loop: ast.AST, attr: str) -> bool:
    """Whether ``<anything>.attr`` is stored to, or ``setattr`` called, where it could run
    between two passes of ``loop``: anywhere in the project but an ``__init__`` or the code
    of ``call``'s function outside the loop."""
    stores, any_setattr = _attribute_stores(script)
    if any_setattr:
        return True
    scope = script.scope(call)
    for module, node in stores.get(attr, []):
        where = module.scope(node)
        if getattr(where, "name", None) == "__init__":
            continue
        if module is script and where is scope and loop not in script.ancestors(node):
            continue
        return True
    return False


def _attribute_stores(
    script: Script,
) -> tuple[dict[str, list[tuple[Script, ast.Attribute]]], bool]:
    """(attribute name -> where the project stores to it, whether it calls ``setattr``),
    computed once per script."""
    if "attribute_stores" not in script.memo:
        stores: dict[str, list[tuple[Script, ast.Attribute]]] = {}
        any_setattr = False
        for module in script.modules:
            for node in module.nodes(ast.Attribute):
                if isinstance(node.ctx, (ast.Store, ast.Del)):
                    stores.setdefault(node.attr, []).append((module, node))
            any_setattr = any_setattr or any(
                isinstance(c.func, ast.Name) and c.func.id == "setattr"
                for c in module.nodes(ast.Call)
            )
        script.memo["attribute_stores"] = (stores, any_setattr)
    found: tuple[dict[str, list[tuple[Script, ast.Attribute]]], bool] = script.memo[
        "attribute_stores"
    ]
    return found


def _loop_target(script: Script, name: str) -> bool:
    if "loop_targets" not in script.memo:
        loops: list[ast.For | ast.AsyncFor | ast.comprehension] = [
            *script.nodes(ast.For),
            *script.nodes(ast.AsyncFor),
            *script.nodes(ast.comprehension),
        ]
        script.memo["loop_targets"] = {
            n.id for loop in loops for n in ast.walk(loop.target) if isinstance(n, ast.Name)
        }
    targets: set[str] = script.memo["loop_targets"]
    return name in targets


def _rebound_elsewhere(script: Script, name: str) -> bool:
    """``name += ...``, ``global name`` or ``nonlocal name`` anywhere: it may change
    between calls."""
    if "augmented" not in script.memo:
        script.memo["augmented"] = (
            {d for n in script.nodes(ast.AugAssign) if (d := dotted(n.target)) is not None}
            | {name for n in script.nodes(ast.Global) for name in n.names}
            | {name for n in script.nodes(ast.Nonlocal) for name in n.names}
        )
    changed: set[str] = script.memo["augmented"]
    return name in changed
