"""Gradients averaged twice: an all-reduce of each ``p.grad`` after DDP's backward already
averaged them over the processes."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor.names import DDP, dotted
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.script import Script, own_nodes

_ALL_REDUCE = ("torch.distributed.all_reduce", "torch.distributed.all_reduce_coalesced")
#: what registers a function to run on a parameter's gradient during backward
_HOOKS = ("register_hook", "register_post_accumulate_grad_hook")


def _reduces_grads(script: Script, loop: ast.For | ast.AsyncFor) -> ast.Call | None:
    """The ``dist.all_reduce(p.grad...)`` of a loop ``for p in model.parameters():``."""
    if not isinstance(loop.target, ast.Name):
        return None
    variable = loop.target.id
    for node in own_nodes(loop):
        if (
            isinstance(node, ast.Call)
            and script.full_name(node.func) in _ALL_REDUCE
            and node.args
            and (dotted(node.args[0]) or "").startswith(f"{variable}.grad")
        ):
            return node
    return None


def _iterates_parameters(loop: ast.For | ast.AsyncFor) -> str | None:
    """``model`` for ``for p in model.parameters():`` (``named_parameters`` too)."""
    it = loop.iter
    func = it.func if isinstance(it, ast.Call) else None
    if isinstance(func, ast.Attribute) and func.attr in ("parameters", "named_parameters"):
        return dotted(func.value)
    return None


def _ddp_calls(script: Script) -> list[ast.Call]:
    """Calls of DDP, and of the file's own classes that average gradients as DDP does."""
    own = _averaging_wrappers(script)
    local = [
        call
        for call in script.nodes(ast.Call)
        if isinstance(call.func, ast.Name)
        and call.func.id in own
        and call.func.id not in script.imports
    ]
    return [*script.calls(DDP), *local] if own else list(script.calls(DDP))


def _averaging_wrappers(script: Script) -> set[str]:
    """The file's classes that all-reduce gradients from a hook they register on the
    parameters: a DistributedDataParallel of their own (the early PyTorch tutorials')."""
    found: set[str] = set()
    for cls in script.nodes(ast.ClassDef):
        calls = [n for n in ast.walk(cls) if isinstance(n, ast.Call)]
        hooks = any(isinstance(c.func, ast.Attribute) and c.func.attr in _HOOKS for c in calls)
        reduces = any(script.full_name(c.func) in _ALL_REDUCE for c in calls)
        if (
            hooks
            and reduces
            and any(isinstance(n, ast.Attribute) and n.attr == "grad" for n in ast.walk(cls))
        ):
            found.add(cls.name)
    return found


def _wrapped_by_ddp(script: Script) -> set[str]:
    """Names that hold a DDP model, and the names of the models wrapped."""
    names = set(script.instances(DDP))
    for call in _ddp_calls(script):
        parent = script.parents.get(call)
        if isinstance(parent, ast.Assign):  # model = OwnDistributedDataParallel(model)
            names.update(name for t in parent.targets if (name := dotted(t)) is not None)
        if call.args and (inner := dotted(call.args[0])) is not None:
            names.add(inner)
    return names


def _grad_all_reduce_after_ddp(script: Script) -> Iterator[Hit]:
    wrapped = _wrapped_by_ddp(script)
    if not wrapped or any(True for _ in script.method_calls("no_sync")):
        return
    helpers: dict[str, int] = {}  # `def average_gradients(model):` -> the model's position
    loops: list[ast.For | ast.AsyncFor] = [*script.nodes(ast.For), *script.nodes(ast.AsyncFor)]
    for loop in loops:
        model = _iterates_parameters(loop)
        if model is None or (call := _reduces_grads(script, loop)) is None:
            continue
        scope = script.scope(loop)
        params = [a.arg for a in getattr(getattr(scope, "args", None), "args", [])]
        if model in params:  # a helper: which model it reduces is the caller's
            function = isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef)
            if function and not script.in_class(scope):
                helpers[getattr(scope, "name", "")] = params.index(model)
        elif (model.removesuffix(".module") in wrapped or model in wrapped) and not _apart(
            script, call, model.removesuffix(".module")
        ):
            yield _hit(call, model)
    for name, position in helpers.items():  # average_gradients(ddp_model)
        for call in script.nodes(ast.Call):
            if isinstance(call.func, ast.Name) and call.func.id == name:
                arg = call.args[position] if len(call.args) > position else None
                model = dotted(arg) if arg is not None else None
                if model in wrapped and not _apart(script, call, model):
                    yield _hit(call, model)


def _apart(script: Script, reduce: ast.AST, model: str | None) -> bool:
    """Whether every DDP wrap of ``model`` runs under a test that the reduce's contradicts:
    ``if distributed and use_cuda: model = DDP(model)`` then ``if distributed and not
    use_cuda: average_gradients(model)`` (the CPU branch, where DDP was not built)."""
    wraps = [
        call
        for call in _ddp_calls(script)
        if (call.args and dotted(call.args[0]) == model)
        or any(dotted(t) == model for t in getattr(script.parents.get(call), "targets", []))
    ]
    held = _tests(script, reduce)
    return bool(wraps) and all(
        any((name, not value) in held for name, value in _tests(script, wrap)) for wrap in wraps
    )


def _tests(script: Script, node: ast.AST) -> set[tuple[str, bool]]:
    """The name tests that hold where ``node`` runs, within its function: in the body of
    ``if a and not b:``, ``(a, True)`` and ``(b, False)``; in the else of ``if a:``,
    ``(a, False)``."""
    held: set[tuple[str, bool]] = set()
    child = node
    for parent in script.ancestors(node):
        if isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            break
        if isinstance(parent, ast.If):
            atoms = _atoms(parent.test)
            if child in parent.body:
                held |= atoms
            elif child in parent.orelse and len(atoms) == 1:
                held |= {(name, not value) for name, value in atoms}
        child = parent
    return held


def _atoms(test: ast.expr) -> set[tuple[str, bool]]:
    """``a and not b`` -> ``{(a, True), (b, False)}`` (names only; anything else is left out)."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    found: set[tuple[str, bool]] = set()
    for part in parts:
        negated = isinstance(part, ast.UnaryOp) and isinstance(part.op, ast.Not)
        name = dotted(part.operand if isinstance(part, ast.UnaryOp) else part)
        if name is not None:
            found.add((name, not negated))
    return found


def _hit(node: ast.AST, model: str) -> Hit:
    return Hit(
        node,
        f"{model} is trained under DistributedDataParallel, whose backward already averaged "
        "every gradient over the processes: reducing them again doubles the communication, "
        "and a sum makes them N times too large",
        "drop the all-reduce (DDP does it); to reduce by hand, train without DDP",
    )


RULES = [
    Rule(
        "grad-allreduce-after-ddp",
        "gradients all-reduced by hand after DDP already averaged them",
        _grad_all_reduce_after_ddp,
    )
]
