"""A host-device sync on every training step: ``loss.item()``, ``.cpu()``, printing a tensor."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor.hints import uses_accelerator
from paratrain.tools.doctor.names import DATA_PARALLEL, DDP, dotted
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.script import FUNCTIONS, LOOPS, Script, own_nodes

_SYNCING = {"item", "cpu", "tolist", "numpy"}
_CONDITIONAL = (ast.If, ast.IfExp, ast.Try, ast.ExceptHandler, ast.BoolOp)


def _step_bodies(script: Script) -> list[ast.AST]:
    """Code that runs once per step: the innermost loop around each backward pass, or the
    function (or method: ``self._run_batch(...)``) that makes it when that function is
    called from inside a loop."""
    bodies: dict[int, ast.AST] = {}
    looped: set[str] | None = None
    for call in script.method_calls("backward"):
        around = script.loops_around(call)
        if around:
            bodies[id(around[0])] = around[0]
            continue
        function = script.scope(call)
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if looped is None:
            looped = {
                name
                for c in script.nodes(ast.Call)
                if (name := _called_name(c)) is not None and script.loops_around(c)
            }
        if function.name in looped:
            bodies[id(function)] = function
    return list(bodies.values())


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _code(script: Script, body: ast.AST) -> list[ast.AST]:
    return list(own_nodes(body)) if isinstance(body, LOOPS) else script.own(body)


def _every_time(script: Script, node: ast.AST, loop: ast.AST) -> bool:
    """``node`` runs on every pass of ``loop``: no condition (``if step % 100 == 0``) between."""
    for parent in script.ancestors(node):
        if parent is loop:
            return True
        if isinstance(parent, (*_CONDITIONAL, *FUNCTIONS)):
            return False
    return False


def _models(script: Script) -> set[str]:
    models = {
        owner
        for n in script.method_calls("parameters")
        if isinstance(n.func, ast.Attribute) and (owner := dotted(n.func.value)) is not None
    }
    return models | script.instances(DDP, DATA_PARALLEL)


def _tensor_names(script: Script, code: list[ast.AST], models: set[str]) -> set[str]:
    """The loss and the model's outputs, as named in this loop."""
    names: set[str] = set()
    for node in code:
        func = node.func if isinstance(node, ast.Call) else None
        if (
            isinstance(node, ast.Call)
            and isinstance(func, ast.Attribute)
            and func.attr == "backward"
        ):
            # loss.backward(), or rt/accelerator/fabric.backward(loss)
            given = node.args or [func.value]
            names.update(d for a in given if (d := dotted(a)) is not None)
        value = node.value if isinstance(node, ast.Assign) else None
        if (
            isinstance(node, ast.Assign)
            and isinstance(value, ast.Call)
            and dotted(value.func) in models
        ):
            names.update(d for t in node.targets if (d := dotted(t)) is not None)
    return names


def _prints_tensor(call: ast.Call, tensors: set[str], script: Script) -> bool:
    for arg in call.args:
        for n in ast.walk(arg):
            if isinstance(n, ast.Name) and n.id in tensors:
                parent = script.parents.get(n)
                if not isinstance(parent, ast.Attribute):  # loss.item() is reported itself
                    return True
    return False


def _sync_every_step(script: Script) -> Iterator[Hit]:
    if not uses_accelerator(script):
        return  # on the CPU, .item() waits for nothing
    seen: set[int] = set()
    models = _models(script)
    for loop in _step_bodies(script):
        code = _code(script, loop)
        tensors = _tensor_names(script, code, models)
        header = getattr(loop, "iter", None) or getattr(loop, "test", None)
        once = {id(n) for n in ast.walk(header)} if header is not None else set()
        for node in code:
            if not isinstance(node, ast.Call) or not _every_time(script, node, loop):
                continue
            func = node.func
            if id(node) in once:
                continue
            if isinstance(func, ast.Attribute) and func.attr in _SYNCING:
                what = f".{func.attr}()"
            elif (
                isinstance(func, ast.Name)
                and func.id == "print"
                and _prints_tensor(node, tensors, script)
            ):
                what = "printing a tensor"
            else:
                continue
            if node.lineno in seen:
                continue
            seen.add(node.lineno)
            yield Hit(
                node,
                f"{what} on every step: the host waits for the device each step",
                "keep values on the device (total += loss.detach()) and read them once per "
                "epoch or every N steps, under `if step % N == 0:`",
            )


RULES = [
    Rule("sync-every-step", "loss.item(), .cpu() or printing a tensor every step", _sync_every_step)
]
