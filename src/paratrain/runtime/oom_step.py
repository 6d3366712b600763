"""One micro-batch run in pieces, redone with smaller pieces when a process runs out of
memory (:mod:`paratrain.runtime.oom` says what is recovered and what is not)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from paratrain.launching import faults, heartbeat
from paratrain.runtime.nonfinite import NonFiniteCheck
from paratrain.runtime.oom import (
    MicroBatches,
    OutOfMemoryStop,
    Snapshot,
    batch_length,
    cut,
    test_hook,
)
from paratrain.strategies import Strategy


class Accumulation(Protocol):
    """Where gradient accumulation stands (``paratrain.runtime.optim.Accumulation``)."""

    steps: int
    micro_steps: int
    loss_weight: float

    def next_is_last(self) -> bool: ...

    def micro_batch_done(self) -> None: ...


@dataclass
class PieceStep:
    """What running pieces needs from the runtime."""

    strategy: Strategy
    accumulation: Accumulation
    nonfinite: NonFiniteCheck
    micro_batches: MicroBatches
    #: the precision's backward (scaling, deterministic-mode naming included)
    backward: Callable[[torch.Tensor], None]

    def run(
        self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, target: Any
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its (weighted) mean loss."""
        strategy, accumulation = self.strategy, self.accumulation
        collective, device = strategy.collective, strategy.root_device
        ends_step = accumulation.next_is_last()
        first_of_step = accumulation.micro_steps == 0
        step = self.nonfinite.step + 1
        length = batch_length(inputs)
        plan = _pieces(length, self.micro_batches.split)
        total = torch.zeros((), device=device)
        index = 0
        while index < len(plan):
            start, end = plan[index]
            last = index == len(plan) - 1
            syncs = ends_step and (last or strategy.pieces_sync_each)
            quiet = not syncs and ends_step  # otherwise rt.accumulate's no_sync holds
            share = (end - start) / length
            # an empty piece (fewer samples than pieces) still runs, weighted 0: every
            # process runs the same forwards and collectives
            cut_at = (start, end) if end > start else (0, 1)
            snapshot = Snapshot.take(model, device)
            with strategy.no_sync(model) if quiet else contextlib.nullcontext():
                loss, failed = self._forward(model, loss_fn, inputs, target, cut_at, step)
                look = None
                if loss is not None:
                    loss = faults.at_step(collective.rank, step, loss)
                    look = self.nonfinite.look(loss, collective, ends_step and last)
                # one all-reduce: out of memory anywhere, a non-finite loss, a stop
                with heartbeat.waiting():  # waits on the other processes: not a hang here
                    agreed = self.nonfinite.agreement.exchange(
                        collective,
                        step,
                        f"at training step {step}",
                        bad=None if look is None else look.bad,
                        failed=failed,
                        samples=end - start,
                    )
                verdict = None
                if agreed.failed:
                    ranks = self.micro_batches.failed_ranks(collective, failed)
                    verdict = (ranks, agreed.samples)
                else:
                    assert look is not None and loss is not None  # no process failed
                    with heartbeat.waiting():
                        admitted = self.nonfinite.settle(look, collective, agreed.bad)
                        weight = accumulation.loss_weight / accumulation.steps * share
                        communicates = collective.world_size > 1 and (
                            syncs or strategy.collective_forward
                        )
                        nothing_before = first_of_step and index == 0
                        if admitted and self._backward(
                            model, loss * weight, communicates, nothing_before
                        ):
                            verdict = ([collective.rank], end - start)
                            self.nonfinite.step = step - 1  # the step is not done: redone
            if verdict is not None:  # out of memory: every process redoes the piece
                loss = None
                snapshot.restore(device)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                self.micro_batches.halve(collective, verdict[0], verdict[1], step)
                plan = plan[:index] + [half for p in plan[index:] for half in _halves(p)]
                continue
            assert loss is not None
            total += loss.detach().float() * share
            index += 1
        accumulation.micro_batch_done()
        return total

    def _forward(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        inputs: Any,
        target: Any,
        cut_at: tuple[int, int],
        step: int,
    ) -> tuple[torch.Tensor | None, bool]:
        collective = self.strategy.collective
        start, end = cut_at
        try:
            output = model(cut(inputs, start, end))
        except torch.OutOfMemoryError as exc:
            if collective.world_size > 1 and self.strategy.collective_forward:
                raise OutOfMemoryStop(
                    f"rank {collective.rank} ran out of memory inside --strategy "
                    f"{self.strategy.name}'s forward, between its parameter gathers, where the "
                    "other processes wait: it cannot be redone; use a smaller --batch-size or "
                    "--accumulate 2"
                ) from exc
            return None, True
        try:
            loss = loss_fn(output, cut(target, start, end))
            test_hook(collective.rank, end - start, step)
        except torch.OutOfMemoryError:
            return None, True
        return loss, False

    def _backward(
        self, model: nn.Module, loss: torch.Tensor, communicates: bool, nothing_before: bool
    ) -> bool:
        """Run the backward; True if it ran out of memory and can be redone (one process,
        no gradient of the step there before it: they are dropped)."""
        try:
            self.backward(loss)
        except torch.OutOfMemoryError as exc:
            if communicates or not nothing_before or self.strategy.collective.world_size > 1:
                why = (
                    "the other processes wait in the backward's collectives"
                    if communicates or self.strategy.collective.world_size > 1
                    else "gradients of earlier pieces of the step were already summed"
                )
                raise OutOfMemoryStop(
                    f"rank {self.strategy.collective.rank} ran out of memory in the backward "
                    f"pass, where it cannot be redone ({why}); use a smaller --batch-size or "
                    "--accumulate 2"
                ) from exc
            model.zero_grad(set_to_none=True)
            return True
        return False


def _pieces(length: int, split: int) -> list[tuple[int, int]]:
    """``split`` pieces of ``length`` samples, as even as can be."""
    base, extra = divmod(length, split)
    plan, start = [], 0
    for index in range(split):
        end = start + base + (1 if index < extra else 0)
        plan.append((start, end))
        start = end
    return plan


def _halves(piece: tuple[int, int]) -> list[tuple[int, int]]:
    start, end = piece
    middle = start + (end - start + 1) // 2
    return [(start, middle), (middle, end)]
