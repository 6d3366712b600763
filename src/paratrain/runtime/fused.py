"""Fused optimizer steps: one kernel updates every parameter instead of a few per tensor.

``torch.optim.SGD``, ``Adam`` and ``AdamW`` have a fused implementation, chosen only with
``fused=True``; left to themselves (``fused=None``, ``foreach=None``) they use ``foreach``
on CUDA. Unless told otherwise (``fused_optimizer=False``), the runtime switches such an
optimizer to fused when every parameter is a floating-point CUDA tensor. On the CPU fused
kernels exist too but round differently from the default for-loop (they are not bit-identical),
so they are used there only with ``fused_optimizer=True``.

The switch does what the optimizer's constructor does for ``fused=True``: it sets
``fused`` in every parameter group and in ``defaults`` (groups added later), declares
``_step_supports_amp_scaling`` (``GradScaler`` then hands the scale to the fused kernel,
which unscales and skips steps with inf/NaN gradients itself) and asks for the
device/dtype check of the first step. An optimizer the user configured (``fused`` or
``foreach`` set, ``differentiable``, ``capturable``), a subclass (its ``step`` may differ),
or one that already holds state is left alone.
"""

from __future__ import annotations

import torch

from paratrain.utils.errors import UserError

FUSABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def apply_fused(optimizer: torch.optim.Optimizer, setting: bool | None) -> str:
    """Switch ``optimizer`` to its fused step where ``setting`` (None: on CUDA) asks for it.

    Returns what was done, for ``rt.describe()``: ``"fused"``, ``"off"`` or
    ``"unchanged (why)"``. ``setting=True`` on an optimizer that cannot be fused is a ``UserError``.
    """
    if setting is False:
        return "off"
    reason = _why_not(optimizer, require_cuda=setting is None)
    if reason is not None:
        if setting:
            raise UserError(f"fused_optimizer=True: {reason}; pass fused_optimizer=None")
        return f"unchanged ({reason})"
    for group in optimizer.param_groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    optimizer._need_device_dtype_check_for_fused = True  # type: ignore[attr-defined]
    return "fused"


def _why_not(optimizer: torch.optim.Optimizer, require_cuda: bool) -> str | None:
    name = type(optimizer).__name__
    if type(optimizer) not in FUSABLE:
        return f"{name} has no fused step paratrain knows (SGD, Adam, AdamW)"
    if optimizer.state:
        return f"{name} already holds state"
    for group in optimizer.param_groups:
        for key in ("fused", "foreach"):
            if group.get(key) is not None:
                return f"{name} was built with {key}={group[key]}"
        for key in ("differentiable", "capturable"):
            if group.get(key):
                return f"{name} was built with {key}=True"
        for param in group["params"]:
            if not param.is_floating_point():
                return f"{name} holds a {param.dtype} parameter"
            if require_cuda and param.device.type != "cuda":
                return f"parameters on {param.device.type}; fused by default on CUDA only"
            if param.device.type not in ("cuda", "cpu", "mps", "xpu"):
                return f"no fused kernels for {param.device.type}"
    return None
