"""What a name holds: a model wrapped in DDP/DataParallel, compiled, both, or neither.

A value is a tuple of layers, outermost first: ``DDP(torch.compile(m))`` holds
``("ddp", "compile")``, whose ``state_dict()`` keys start with ``module._orig_mod.``. Real
scripts wrap in many spellings, and all of them are read: call chains
(``nn.DataParallel(m).cuda()``), branches (a name wrapped in any branch may be wrapped),
attributes of ``self`` (wrapped in ``__init__``, saved in another method), and unwrapping
(``m.module``, ``m.module if ddp else m``, ``accelerator.unwrap_model(m)``).
"""

from __future__ import annotations

import ast

from paratrain.tools.doctor.names import ACCELERATOR, DATA_PARALLEL, DDP, RUNTIME, dotted
from paratrain.tools.doctor.script import Script

Layers = tuple[str, ...]
WRAP, COMPILE = "ddp", "compile"
#: methods that return the module itself
_SAME = {"cuda", "to", "cpu", "float", "half", "double", "bfloat16", "train", "eval", "to_empty"}
_DEPTH = 6
_RECENT = 8
_KEPT = 3  # layers kept, outermost first: what the keys start with, and under a `.module`


class Wrappers:
    def __init__(self, script: Script) -> None:
        self.script = script
        self._memo: dict[tuple[str, int, int], set[Layers]] = {}
        self.preparers = script.instances(ACCELERATOR) | script.instances(RUNTIME)
        self._models = {
            owner
            for attr in ("parameters", "named_parameters")
            for call in script.method_calls(attr)
            if isinstance(call.func, ast.Attribute)
            and (owner := dotted(call.func.value)) is not None
        }

    def any_wrapping(self) -> bool:
        """Whether the script wraps or compiles anything at all (else no question to ask)."""
        s = self.script
        return bool(
            any(True for _ in s.calls(DDP, DATA_PARALLEL, "torch.compile"))
            or (self.preparers and self._models)
        )

    def of(self, node: ast.expr, at: ast.AST, depth: int = 0) -> set[Layers]:
        """The layers ``node`` may hold when the statement ``at`` runs."""
        if depth > _DEPTH:
            return set()
        if isinstance(node, ast.IfExp):
            unwrapped = _unwrap_idiom(node)
            if unwrapped is not None:  # `model.module if ddp else model`
                inner = self.of(unwrapped, at, depth + 1)
                return {v[1:] if v and v[0] == WRAP else v for v in inner}
            return self.of(node.body, at, depth + 1) | self.of(node.orelse, at, depth + 1)
        if isinstance(node, ast.Call):
            return self._call(node, at, depth)
        if isinstance(node, ast.Attribute) and node.attr in ("module", "_orig_mod"):
            layer = WRAP if node.attr == "module" else COMPILE
            inner = self.of(node.value, at, depth + 1)
            return {v[1:] for v in inner if v and v[0] == layer} or {()}
        name = dotted(node)
        if name is None:
            return set()
        return self._name(name, at, depth)

    def _call(self, call: ast.Call, at: ast.AST, depth: int) -> set[Layers]:
        full = self.script.full_name(call.func)
        first = call.args[0] if call.args else None
        if full in (DDP, DATA_PARALLEL, "torch.compile"):
            module = first if first is not None else _keyword(call, "module", "model")
            inner = self.of(module, at, depth + 1) if module is not None else set()
            layer = COMPILE if full == "torch.compile" else WRAP
            return {(layer, *v)[:_KEPT] for v in inner or {()}}
        func = call.func
        if isinstance(func, ast.Attribute):
            if func.attr in _SAME:
                return self.of(func.value, at, depth + 1)
            if func.attr == "unwrap_model":
                return {()}
        return set()

    def _name(self, name: str, at: ast.AST, depth: int) -> set[Layers]:
        """Union over the assignments to ``name`` that may be the latest when ``at`` runs."""
        script = self.script
        line = getattr(at, "lineno", 0)
        scope = script.scope(at)
        key = (name, id(scope), line)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = set()  # a name defined from itself: no answer while it is asked
        if name.startswith("self."):
            cls = script.owner_class(at)
            values = [
                (v, s)
                for v, s in script.assigned.get(name, [])
                if script.owner_class(s) is cls
                and (script.scope(s) is not scope or s.lineno < line)
            ]
        else:
            values = [(v, s) for v, s in script.assigned_in(scope, name) if s.lineno < line]
            if not values and scope is not script.tree:  # a global the function reads
                values = script.assigned_in(script.tree, name)
        values = values[-_RECENT:]  # older ones are overwritten in any script a person writes
        live = [
            (v, s)
            for index, (v, s) in enumerate(values)
            if not _overwritten(script, s, [later for _, later in values[index + 1 :]])
        ]
        found: set[Layers] = set()
        for value, statement in live:
            found |= self._assigned(name, value, statement, depth)
        self._memo[key] = found
        return found

    def _assigned(self, name: str, value: ast.expr, statement: ast.stmt, depth: int) -> set[Layers]:
        if isinstance(statement, ast.Assign) and isinstance(statement.targets[0], ast.Tuple):
            # `model, optimizer = accelerator.prepare(model, optimizer)`
            call = value if isinstance(value, ast.Call) else None
            if call is not None and isinstance(call.func, ast.Attribute):
                prepares = call.func.attr in ("prepare", "setup")
                if prepares and dotted(call.func.value) in self.preparers:
                    names = [dotted(e) for e in statement.targets[0].elts]
                    index = names.index(name) if name in names else -1
                    if 0 <= index < len(call.args) and dotted(call.args[index]) in self._models:
                        return {(WRAP,)}
                    return {()}
        return self.of(value, statement, depth + 1)


def _overwritten(script: Script, earlier: ast.stmt, laters: list[ast.stmt]) -> bool:
    """One of ``laters`` runs after ``earlier`` whenever ``earlier`` ran: it comes after it
    in the same block or in a block around it (branches aside, a plain sequence)."""
    for later in laters:
        if later.lineno <= earlier.lineno or later not in script.blocks:
            continue
        if script.in_block(earlier, script.blocks[later][0]) is not None:
            return True
    return False


def _unwrap_idiom(node: ast.IfExp) -> ast.expr | None:
    """``X`` of ``X.module if <test> else X`` (or the other way round), else None."""
    for one, other in ((node.body, node.orelse), (node.orelse, node.body)):
        if (
            isinstance(one, ast.Attribute)
            and one.attr == "module"
            and dotted(one.value) is not None
            and dotted(one.value) == dotted(other)
        ):
            return other
    return None


def _keyword(call: ast.Call, *names: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg in names:
            return kw.value
    return None
