"""Sharded tensors (``DTensor``, what FSDP2 makes of parameters and optimizer state) seen as
the plain full tensors every other layout has.

Gathering a full tensor is a collective: every process of the mesh must call it, in the same
order. Splitting a full tensor into this process's shard needs no communication: every
process holds the same full tensor (each reads the same checkpoint).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def is_sharded(tensor: Any) -> bool:
    return isinstance(tensor, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathered if sharded (a collective), else itself."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a full tensor) laid out like ``like``: this process's shard when ``like``
    is sharded, ``value`` itself otherwise."""
    if not isinstance(like, DTensor) or isinstance(value, DTensor):
        return value
    local = value.to(device=like.device, dtype=like.dtype)
    # src_data_rank=None: every process splits its own copy, nothing is sent.
    return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this process holds of ``tensor`` (its shard, if sharded)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()
