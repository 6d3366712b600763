"""``torch.compile`` of the model: which mode, on which strategies, and what it cost.

``compile=True`` (``--compile``) picks the mode per device: ``reduce-overhead`` for one
process on one CUDA GPU, where a step of a small model is bound by kernel launches and CUDA
graphs remove them; ``default`` elsewhere (CPU, MPS, and ``ddp``, whose gradient hooks run
between the compiled graphs, so CUDA graphs would capture little and cost memory). A mode
name (``default``, ``reduce-overhead``, ``max-autotune``, ``max-autotune-no-cudagraphs``)
is used as given. ``strict`` is ``auto`` whose compile check
(:mod:`paratrain.runtime.compile_check`) raises instead of falling back to eager.

The model is compiled with ``dynamic=False``: every distinct batch shape gets its own static
graph (the fastest kernels, and what CUDA graphs need). The uneven last batch of an epoch
therefore compiles once more, the first time only; :func:`compile_counts` lets the training
loop report how many graphs were compiled and how long that took.

``dp`` and ``dp-balanced`` run replicas of the model in threads, which ``torch.compile``
does not support: they are refused, never silently left uncompiled.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from paratrain.utils.errors import UserError

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: what ``compile=True`` stands for until the strategy is known
AUTO = "auto"
#: strategies whose model runs in threads (DataParallel replicas): torch.compile refuses


#: ``"auto"``, and an error instead of a fall back when the compile check disagrees
STRICT = "strict"


def normalize_compile(value: bool | str | None) -> str | None:
    """``None`` (no compile), ``"auto"`` (``True``), ``"strict"`` or a mode name;
    ``UserError`` otherwise."""
    if value is None or value is False:
        return None
    if value is True or value == AUTO:
        return AUTO
    if isinstance(value, str) and (value in MODES or value == STRICT):
        return value
    valid = ", ".join((*MODES, STRICT))
    raise UserError(f"unknown compile mode {value!r}; valid modes: {valid}")


def resolve_mode(setting: str, strategy_mode: str) -> str:
    """The torch.compile mode ``setting`` (``"auto"``, ``"strict"`` or a mode) means for a
    strategy whose own choice is ``strategy_mode`` (``Strategy.compile_mode``)."""
    if setting not in (AUTO, STRICT):
        return setting
    return strategy_mode


def check_compile(
    refused: str | None, mode: str, device: torch.device, setting: str | None
) -> None:
    """Raise a one-line ``UserError`` where ``torch.compile`` cannot run: the strategy
    ``refused`` it (its reason), or its processes' ``device`` cannot in ``mode``."""
    if setting is None:
        return
    if refused is not None:
        raise UserError(refused)
    reason = _unsupported_reason(device, resolve_mode(setting, mode))
    if reason is not None:
        raise UserError(f"--compile on {device.type}: {reason}; drop --compile")


def _unsupported_reason(device: torch.device, mode: str) -> str | None:
    from torch._dynamo.eval_frame import is_dynamo_supported

    if not is_dynamo_supported():
        return f"torch.compile does not support Python {sys.version.split()[0]} on this platform"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "torch.compile needs Triton for CUDA kernels (pip install triton)"
    elif device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception:  # inductor raises various errors when no compiler is found
            return "torch.compile needs a C++ compiler (g++ or clang++) for CPU kernels"
    elif device.type != "mps":
        return f"paratrain does not compile for {device.type} devices"
    if mode == "reduce-overhead" and device.type != "cuda":
        return f"mode {mode} uses CUDA graphs, which need a CUDA device"
    return None


def compile_model(model: nn.Module, mode: str) -> nn.Module:
    """``torch.compile(model)``: its state dict gains an ``_orig_mod.`` prefix, which
    :mod:`paratrain.checkpoints.weights` strips from every file paratrain writes."""
    compiled: nn.Module = torch.compile(model, mode=mode, dynamic=False)  # type: ignore[assignment]
    return compiled


def compile_counts() -> tuple[int, float]:
    """Graphs compiled and seconds spent compiling so far in this process (dynamo's own
    counters; zeros where nothing was ever compiled)."""
    if "torch._dynamo" not in sys.modules:
        return 0, 0.0
    from torch._dynamo.utils import calculate_time_spent, counters

    seconds: Any = calculate_time_spent().get("total_wall_time", 0.0)
    return int(counters["stats"]["unique_graphs"]), float(seconds)
