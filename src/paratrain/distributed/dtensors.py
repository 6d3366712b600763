"""Sharded tensors (``DTensor``, what FSDP2 makes of parameters and optimizer state) seen as
the plain full tensors every other layout has.

Gathering a full tensor is a collective: every process of the mesh must call it, in the same
order. Splitting a full tensor into this process's shard needs no communication: every
process holds the same full tensor (each reads the same checkpoint).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

#: torch.distributed.tensor takes a second to import (it loads torch._dynamo), and a DTensor
#: exists only once it is imported (by FSDP): until then nothing is sharded.
_MODULE = "torch.distributed.tensor"


def is_sharded(tensor: Any) -> TypeGuard[DTensor]:
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(tensor, module.DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathered if sharded (a collective), else itself."""
    if is_sharded(tensor):
        return tensor.full_tensor()
    return tensor


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a full tensor) laid out like ``like``: this process's shard when ``like``
    is sharded, ``value`` itself otherwise."""
    if not is_sharded(like) or is_sharded(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    local = value.to(device=like.device, dtype=like.dtype)
    # src_data_rank=None: every process splits its own copy, nothing is sent.
    return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this process holds of ``tensor`` (its shard, if sharded)."""
    local = tensor.to_local() if is_sharded(tensor) else tensor
    return local.numel() * local.element_size()
