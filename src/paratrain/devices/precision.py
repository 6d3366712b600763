"""Precision policies: autocast around the forward pass, GradScaler for fp16 on CUDA."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.utils.errors import UserError

PRECISIONS = ("32", "bf16", "fp16")
_ALIASES = {
    "32": "32",
    "fp32": "32",
    "32-true": "32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "fp16": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def normalize_precision(name: str | int) -> str:
    key = str(name).lower()
    if key not in _ALIASES:
        raise UserError(f"unknown precision {name!r}; valid precisions: {', '.join(PRECISIONS)}")
    return _ALIASES[key]


def precision_unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why ``name`` cannot run on ``device`` here, or None."""
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return f"{torch.cuda.get_device_name(device)} does not support bf16"
    if name != "32" and device.type not in ("cpu", "cuda", "mps"):
        return f"autocast is not available on {device.type}"
    return None


def to_float32(output: Any) -> Any:
    """Outputs leave the autocast region as float32, so the loss is computed precisely."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.is_floating_point() else output
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        return type(output)(*(to_float32(o) for o in output))
    if isinstance(output, (list, tuple)):
        return type(output)(to_float32(o) for o in output)
    if isinstance(output, dict):
        return type(output)((k, to_float32(v)) for k, v in output.items())
    return output


class Precision:
    """One precision setting for one device type."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = normalize_precision(name)
        self.device = device
        reason = precision_unavailable_reason(self.name, device)
        if reason is not None:
            raise UserError(f"--precision {self.name}: {reason}; use --precision 32")
        self.dtype: torch.dtype | None = _DTYPES.get(self.name)
        self.scaler: torch.amp.GradScaler | None = None
        if self.name == "fp16" and device.type == "cuda":
            self.scaler = torch.amp.GradScaler("cuda")

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def wrap_forward(self, model: nn.Module) -> nn.Module:
        """Run ``model``'s forward under autocast (the state_dict is untouched)."""
        if self.dtype is None:
            return model
        forward: Callable[..., Any] = model.forward
        autocast = self.autocast

        @functools.wraps(forward)
        def forward_in_autocast(*args: Any, **kwargs: Any) -> Any:
            with autocast():
                output = forward(*args, **kwargs)
            return to_float32(output)

        model.forward = forward_in_autocast
        return model

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result

    def unscale(self, optimizer: Any) -> None:
        """Before clipping gradients under fp16, bring them back to their true scale."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
