"""The runtime's collectives (``rt.all_reduce``, ``rt.all_gather``, ``rt.broadcast_object``,
``rt.barrier``, and a shuffled loader's seed at the start of its epoch): each named for the
collective-order check, each first checking that every rank is in the same call with the
same tensor (:mod:`paratrain.runtime.call_check`), which also agrees on a pending
non-finite loss so that no process waits in a collective the others left."""

from __future__ import annotations

from typing import TypeVar

import torch

from paratrain.distributed.collective import ReduceOp
from paratrain.runtime.call_check import SHUFFLE, Call, check_call
from paratrain.runtime.evaluation_notes import EvaluationNotes
from paratrain.runtime.parts import RuntimeParts

T = TypeVar("T")


class RuntimeCollectives:
    """The collectives a user's loop calls through the runtime."""

    def __init__(self, rt: RuntimeParts, notes: EvaluationNotes) -> None:
        self.rt = rt
        self.notes = notes

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self.notes.reduced()
        collective = self.rt.strategy.collective
        with collective.operation("rt.all_reduce"):
            self._agree(Call.of("rt.all_reduce", tensor, op=op))
            return collective.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.notes.reduced()
        collective = self.rt.strategy.collective
        with collective.operation("rt.all_gather"):
            self._agree(Call.of("rt.all_gather", tensor))
            return collective.all_gather(tensor)

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        collective = self.rt.strategy.collective
        with collective.operation("rt.broadcast_object"):
            self._agree(Call.of("rt.broadcast_object", src=src))
            return collective.broadcast_object(obj, src)  # type: ignore[no-any-return,unused-ignore]

    def barrier(self) -> None:
        collective = self.rt.strategy.collective
        with collective.operation("rt.barrier"):
            self._agree(Call.of("rt.barrier"))
            collective.barrier()

    def _agree(self, call: Call) -> None:
        """Before a collective of the user's: every rank in the same call (the step's
        agreement with a step of -1: a rank still training meets it in its step)."""
        check_call(self.rt, call, f"in {call.name} after {self.rt.state.step} training steps")

    def agree_seed(self, seed: int) -> int:
        """Rank 0's draw of a loader's permutation seed, on every process."""
        collective = self.rt.strategy.collective
        with collective.operation(SHUFFLE):
            self._agree(Call.of(SHUFFLE))
            return int(collective.broadcast_object(seed))
