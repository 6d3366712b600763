"""Putting batches on a device: once, without needless host copies (seed 002)."""

from __future__ import annotations

from typing import Any

import torch

from paratrain.utils.errors import PlacementError


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in nested tuples, lists and dicts to ``device``.

    Pinned CPU tensors go to CUDA with ``non_blocking=True``: the copy overlaps with the
    work already queued instead of stalling the host.
    """
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        non_blocking = device.type == "cuda" and batch.is_pinned()
        try:
            return batch.to(device, non_blocking=non_blocking)
        except (RuntimeError, TypeError) as exc:
            raise PlacementError(
                f"cannot place a {tuple(batch.shape)} {batch.dtype} tensor from {batch.device} "
                f"on {device}: {str(exc).splitlines()[0]}"
            ) from None
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(item, device) for item in batch))
    if type(batch) is tuple or type(batch) is list:  # the common (x, y) batch: no generator
        return type(batch)([move_to_device(item, device) for item in batch])
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return type(batch)((key, move_to_device(value, device)) for key, value in batch.items())
    return batch


def check_inputs_on(device: torch.device, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise a clear error when a top-level input tensor sits on another device.

    Without it the user gets PyTorch's "Expected all tensors to be on the same device"
    from deep inside a layer (seed 003's pitfall).
    """
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.device.type != device.type:
            raise PlacementError(
                f"the model is on {device} but got an input on {value.device}; pass batches "
                "through rt.setup_loader(loader) or move them with rt.to_device(x)"
            )
