"""Small judgements shared by rules: is this a device, does the script use a GPU."""

from __future__ import annotations

import ast
import re

from paratrain.tools.doctor.names import ACCELERATOR, FABRIC, RUNTIME
from paratrain.tools.doctor.script import Script, keyword

_DEVICE_WORDS = re.compile(r"device|gpu|cuda|rank|mps", re.IGNORECASE)


def is_device(script: Script, node: ast.expr) -> bool:
    """Whether ``node`` (an argument of ``.to()``) names a device rather than a dtype."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            return node.value.split(":")[0] in ("cuda", "mps", "xpu")
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    if isinstance(node, ast.Call):
        return script.full_name(node.func) == "torch.device"
    if isinstance(node, ast.Name | ast.Attribute):
        last = node.id if isinstance(node, ast.Name) else node.attr
        return bool(_DEVICE_WORDS.search(last))
    return False


def moves_to_device(script: Script, call: ast.Call) -> bool:
    """``x.cuda(...)`` or ``x.to(<a device>)``."""
    if not isinstance(call.func, ast.Attribute):
        return False
    if call.func.attr == "cuda":
        return True
    if call.func.attr != "to":
        return False
    target = keyword(call, "device", 0)
    return target is not None and is_device(script, target)


def uses_cuda(script: Script) -> bool:
    """The script names CUDA itself: ``.cuda()``, ``torch.cuda``, "cuda", nccl."""
    for node in script.nodes(ast.Constant):
        text = node.value
        if isinstance(text, str) and (text.startswith("cuda") or text == "nccl"):
            return True
    return any(node.attr == "cuda" for node in script.nodes(ast.Attribute))


def uses_accelerator(script: Script) -> bool:
    """The script runs on a GPU when there is one: it names CUDA or MPS, or a library that
    picks the device (Accelerate, Fabric, Horovod, paratrain)."""
    if uses_cuda(script):
        return True
    if any(n.id == "mps" for n in script.nodes(ast.Name)) or any(
        n.attr == "mps" for n in script.nodes(ast.Attribute)
    ):
        return True
    if any(str(n.value).startswith("mps") for n in script.nodes(ast.Constant)):
        return True
    picks_device = (ACCELERATOR, FABRIC, RUNTIME)
    return any(True for _ in script.calls(*picks_device)) or script.uses("horovod")
