"""The runtime's collectives (``rt.all_reduce``, ``rt.all_gather``, ``rt.broadcast_object``,
``rt.barrier``): each named for the collective-order check, each first agreeing on a
pending non-finite loss so that no process waits in a collective the others left."""

from __future__ import annotations

from typing import TypeVar

import torch

from paratrain.distributed.collective import Collective, ReduceOp
from paratrain.runtime.agreement import BEFORE_COLLECTIVE
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
            self._agree(collective, "all_reduce")
            return collective.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.notes.reduced()
        collective = self.rt.strategy.collective
        with collective.operation("rt.all_gather"):
            self._agree(collective, "all_gather")
            return collective.all_gather(tensor)

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        collective = self.rt.strategy.collective
        with collective.operation("rt.broadcast_object"):
            self._agree(collective, "broadcast_object")
            return collective.broadcast_object(obj, src)  # type: ignore[no-any-return,unused-ignore]

    def barrier(self) -> None:
        collective = self.rt.strategy.collective
        with collective.operation("rt.barrier"):
            self._agree(collective, "barrier")
            collective.barrier()

    def _agree(self, collective: Collective, what: str) -> None:
        """Before a collective of the user's: check that every rank is at one too (the
        step's agreement with a step of -1: a rank still training meets it in its step)."""
        state = self.rt.state
        state.agreement.settle(collective)  # the last step's checks first (a NaN raises)
        # the same small all-reduce catches a rank still training: part of the check that
        # --no-collective-check turns off
        checks = self.rt.config.collective_check
        if checks and collective.world_size > 1 and not state.local_only:
            here = f"in rt.{what} after {state.step} training steps"
            state.agreement.exchange(collective, BEFORE_COLLECTIVE, here)

    def agree_seed(self, seed: int) -> int:
        """Rank 0's draw of a loader's permutation seed, on every process."""
        collective = self.rt.strategy.collective
        with collective.operation("the shuffle of a loader (at the start of its epoch)"):
            return int(collective.broadcast_object(seed))
