"""Putting batches on a device: once, without needless host copies (seed 002)."""

from __future__ import annotations

from typing import Any

import torch

from paratrain.utils.errors import PlacementError


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in nested tuples, lists and dicts to ``device``.

    Pinned CPU tensors go to CUDA with ``non_blocking=True``: the copy overlaps with the
    work already queued instead of stalling the host. It runs for every batch: a tensor
    already there costs one check, with no call.
    """
    on_cpu = device.type == "cpu"
    if isinstance(batch, torch.Tensor):
        if batch.is_cpu if on_cpu else batch.device == device:
            return batch
        return _moved(batch, device)
    if type(batch) is tuple or type(batch) is list:  # the common (x, y) batch
        for item in batch:
            if not isinstance(item, torch.Tensor):
                break
            if not (item.is_cpu if on_cpu else item.device == device):
                break
        else:
            return batch  # every tensor there already: the batch as it is, no call per item
        return type(batch)([move_to_device(item, device) for item in batch])
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(item, device) for item in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return type(batch)((key, move_to_device(value, device)) for key, value in batch.items())
    return batch


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    non_blocking = device.type == "cuda" and tensor.is_pinned()
    try:
        return tensor.to(device, non_blocking=non_blocking)
    except (RuntimeError, TypeError) as exc:
        raise PlacementError(
            f"cannot place a {tuple(tensor.shape)} {tensor.dtype} tensor from {tensor.device} "
            f"on {device}: {str(exc).splitlines()[0]}"
        ) from None


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
