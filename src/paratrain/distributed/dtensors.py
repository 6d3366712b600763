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
        gathered = _strided_full(tensor)
        return gathered if gathered is not None else tensor.full_tensor()
    return tensor


def _strided_full(tensor: DTensor) -> torch.Tensor | None:
    """The whole of ``tensor`` when a ``_StridedShard`` splits a dimension that no other
    mesh dimension splits (tensor parallel's fused qkv: each process holds its part of q, k
    and v), gathered as a plain ``Shard`` and put back in order; None for other tensors.
    torch 2.11 cannot redistribute such a placement (it reads it as a shard order)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = tensor.device_mesh
    cuts = {  # mesh dim -> (tensor dim, pieces that dim is cut into)
        m: (p.dim, mesh.size(m) * getattr(p, "split_factor", 1))
        for m, p in enumerate(tensor.placements)
        if isinstance(p, Shard | _StridedShard)
    }
    dims = [dim for dim, _ in cuts.values()]
    if (
        not any(isinstance(p, _StridedShard) for p in tensor.placements)
        or len(set(dims)) < len(dims)
        or any(tensor.shape[dim] % pieces for dim, pieces in cuts.values())
    ):
        return None
    plain = [Shard(cuts[m][0]) if m in cuts else p for m, p in enumerate(tensor.placements)]
    whole = DTensor.from_local(tensor.to_local(), mesh, plain, run_check=False).full_tensor()
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, _StridedShard):
            # gathered along its dim as [process][part][chunk]; the tensor's order is
            # [part][process][chunk]
            dim, parts = placement.dim, placement.split_factor
            whole = whole.unflatten(dim, (mesh.size(mesh_dim), parts, -1))
            whole = whole.transpose(dim, dim + 1).flatten(dim, dim + 2)
    return whole


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
