"""The runtime's collectives (``rt.all_reduce``, ``rt.all_gather``, ``rt.broadcast_object``,
``rt.barrier``, and a shuffled loader's seed at the start of its epoch): each named for the
collective-order check, each first checking that every rank is in the same call with the
same tensor (:mod:`paratrain.runtime.call_check`), which also agrees on a pending
non-finite loss so that no process waits in a collective the others left.

``rt.all_reduce`` and ``rt.all_gather`` combine the values of the data (``over="data"``, the
default): one process per part of the data, so that a count made from the batches counts
each sample once on every layout. That is every process, except under ``pipeline``, where
the stages of a pipeline hold the same batch and get the same output: there the first
stage's value stands for the pipeline (the others' are gathered and left out, so every
process still runs the same collective). ``over="processes"``: every process's value, for
what differs between a pipeline's stages (their parameters, their memory).
"""

from __future__ import annotations

import functools
from typing import TypeVar

import torch

from paratrain.distributed.collective import ReduceOp
from paratrain.runtime.call_check import SHUFFLE, Call, check_call
from paratrain.runtime.evaluation_notes import EvaluationNotes
from paratrain.runtime.parts import RuntimeParts
from paratrain.utils.errors import UserError

T = TypeVar("T")

#: what ``rt.all_reduce`` and ``rt.all_gather`` may combine: the parts of the data, or processes
OVER = ("data", "processes")
_REDUCE_OPS = ("sum", "mean", "max", "min")


class RuntimeCollectives:
    """The collectives a user's loop calls through the runtime."""

    def __init__(self, rt: RuntimeParts, notes: EvaluationNotes) -> None:
        self.rt = rt
        self.notes = notes

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = "sum", over: str = "data"
    ) -> torch.Tensor:
        leaders = self._leaders(over)
        if leaders is not None and op not in _REDUCE_OPS:  # before any process waits
            raise UserError(f"unknown reduce op {op!r}; use one of: {', '.join(_REDUCE_OPS)}")
        self.notes.reduced()
        collective = self.rt.strategy.collective
        with collective.operation("rt.all_reduce"):
            self._agree(Call.of("rt.all_reduce", tensor, op=op))
            if leaders is None:
                return collective.all_reduce(tensor, op)
            return _reduce([collective.all_gather(tensor)[r] for r in leaders], op)

    def all_gather(self, tensor: torch.Tensor, over: str = "data") -> list[torch.Tensor]:
        leaders = self._leaders(over)
        self.notes.reduced()
        collective = self.rt.strategy.collective
        with collective.operation("rt.all_gather"):
            self._agree(Call.of("rt.all_gather", tensor))
            gathered = collective.all_gather(tensor)
            return gathered if leaders is None else [gathered[r] for r in leaders]

    def _leaders(self, over: str) -> list[int] | None:
        """The ranks whose values count, or None where every process's does."""
        if over not in OVER:
            raise UserError(f"over={over!r}: use one of {', '.join(map(repr, OVER))}")
        strategy = self.rt.strategy
        leaders = strategy.data_leaders
        if over == "processes" or len(leaders) == strategy.collective.world_size:
            return None
        return leaders

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


def _reduce(parts: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """``op`` over the leaders' values, in rank order (one leader: its value, exactly)."""
    if op in ("max", "min"):
        pick = torch.maximum if op == "max" else torch.minimum
        return functools.reduce(pick, parts)
    total = functools.reduce(torch.add, parts)
    return total / len(parts) if op == "mean" else total
