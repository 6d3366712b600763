"""Channels-last memory format for convolutional models.

On CUDA, convolutions with tensor cores run fastest on NHWC ("channels last") tensors;
``torch.channels_last`` keeps the NCHW shape and only changes the strides. It is applied
automatically (``channels_last=None``) to a model with a ``Conv2d`` on a CUDA device, and
never automatically on the CPU, where it rarely helps; ``True`` forces it anywhere and
``False`` turns it off. Results stay the same up to floating-point rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(module, nn.Conv2d) for module in model.modules())


def wants_channels_last(setting: bool | None, model: nn.Module, device: torch.device) -> bool:
    """Whether to use channels last: ``setting`` when given, else CUDA and a Conv2d."""
    if setting is not None:
        return setting
    return device.type == "cuda" and has_conv2d(model)


def to_channels_last(obj: Any) -> Any:
    """A 4-D floating-point tensor in channels-last strides (inside tuples, lists, dicts
    too); anything else unchanged."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 4 and obj.is_floating_point():
            return obj.contiguous(memory_format=torch.channels_last)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_channels_last(o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_channels_last(o) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, to_channels_last(v)) for k, v in obj.items())
    return obj


def convert_model(model: nn.Module) -> None:
    """Give ``model``'s 4-D parameters and buffers channels-last strides, in place."""
    model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]


def convert_inputs(model: nn.Module) -> nn.Module:
    """Make ``model``'s forward turn 4-D input batches channels-last before running."""
    forward: Callable[..., Any] = model.forward

    @functools.wraps(forward)
    def forward_channels_last(*args: Any, **kwargs: Any) -> Any:
        return forward(*to_channels_last(args), **to_channels_last(kwargs))

    model.forward = forward_channels_last
    return model


def match_parameter_layout(optimizer: torch.optim.Optimizer) -> None:
    """Keep the optimizer's per-parameter state in its parameter's strides, now and after
    every ``load_state_dict`` (a checkpoint saved without channels last): fused optimizer
    kernels need parameters, gradients and state laid out alike."""
    _relayout_state(optimizer)
    optimizer.register_load_state_dict_post_hook(_relayout_state)


def _relayout_state(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.shape == param.shape
                    and value.stride() != param.stride()
                ):
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
