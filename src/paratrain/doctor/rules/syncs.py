"""A host-device sync on every training step: ``loss.item()``, ``.cpu()``, printing a tensor."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.doctor.hints import uses_accelerator
from paratrain.doctor.names import DATA_PARALLEL, DDP, dotted
from paratrain.doctor.rules.base import Hit, Rule
from paratrain.doctor.script import FUNCTIONS, LOOPS, Script, own_nodes

_SYNCING = {"item", "cpu", "tolist", "numpy"}
_CONDITIONAL = (ast.If, ast.IfExp, ast.Try, ast.ExceptHandler, ast.BoolOp)


def _step_loops(script: Script) -> list[ast.AST]:
    """The innermost loop around each backward pass: its body runs once per step."""
    loops: list[ast.AST] = []
    for call in script.method_calls("backward"):
        around = script.loops_around(call)
        if around and not any(around[0] is loop for loop in loops):
            loops.append(around[0])
    return loops


def _every_time(script: Script, node: ast.AST, loop: ast.AST) -> bool:
    """``node`` runs on every pass of ``loop``: no condition (``if step % 100 == 0``) between."""
    for parent in script.ancestors(node):
        if parent is loop:
            return True
        if isinstance(parent, (*_CONDITIONAL, *FUNCTIONS)):
            return False
    return False


def _tensor_names(script: Script, loop: ast.AST) -> set[str]:
    """The loss and the model's outputs, as named in this loop."""
    models = {
        owner
        for n in ast.walk(script.tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "parameters"
        and (owner := dotted(n.func.value)) is not None
    }
    models |= {
        dotted(t) or ""
        for n in ast.walk(script.tree)
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and script.full_name(n.value.func) in (DDP, DATA_PARALLEL)
        for t in n.targets
    }
    names: set[str] = set()
    for node in own_nodes(loop):
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
    for loop in _step_loops(script):
        assert isinstance(loop, LOOPS)
        tensors = _tensor_names(script, loop)
        for node in own_nodes(loop):
            if not isinstance(node, ast.Call) or not _every_time(script, node, loop):
                continue
            func = node.func
            if any(
                node is n
                for n in ast.walk(loop.iter if not isinstance(loop, ast.While) else loop.test)
            ):
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
