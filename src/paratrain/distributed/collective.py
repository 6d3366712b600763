"""How processes talk to each other, seen from one process: the small interface that the
modules below the runtime need (checkpoints, launching) instead of the Runtime itself.

:class:`Collective` is also the implementation for a run of one process, where every
operation returns its input. Being an object rather than an ``if distributed`` branch lets
the loop call ``all_reduce`` unconditionally (ignite's ``_SerialModel`` idea); the
distributed strategies subclass it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

ReduceOp = str  # "sum" | "mean" | "max" | "min"


#: one shared do-nothing context (it holds no state): no object made per step
_NOTHING = contextlib.nullcontext()


class Reduction:
    """An all-reduce started and not waited for: :meth:`result` waits (if it must)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    @property
    def device(self) -> torch.device:
        return self._tensor.device

    def result(self) -> torch.Tensor:
        return self._tensor


class Collective:
    """Collectives of a one-process run: every operation returns its input."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return tensor

    def start_all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> Reduction:
        """:meth:`all_reduce` without waiting for the other processes: the step's agreement
        travels while the backward runs (``op``: sum, max or min)."""
        return Reduction(tensor)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def operation(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Around one of the runtime's collectives, ``name`` as the user calls it: several
        processes number them and compare (:mod:`paratrain.distributed.collective_order`)."""
        return _NOTHING

    def note(self, message: str) -> None:
        """A remark for the user on standard error, from the main process only."""
        if self.is_main:
            print(message, file=sys.stderr)
