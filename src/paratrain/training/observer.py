"""What watches the training loop (the run's files, loggers, the progress bar, the profiler)
does so through one small interface, :class:`LoopObserver`, whose hooks the loop calls at
fixed moments; :mod:`paratrain.training.loggers` builds the run's observers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class StepReport:
    """After one batch: ``step`` optimizer steps and ``samples`` samples (all processes) in
    the run so far. ``loss`` is the batch's, on the device: reading it waits for the device,
    so an observer reads it only when it shows it."""

    epoch: int
    step: int
    samples: int
    loss: torch.Tensor


@dataclass(frozen=True)
class EpochReport:
    """An epoch trained and evaluated: the losses are means over every process."""

    epoch: int
    step: int
    samples: int
    train_loss: float
    eval_loss: float
    eval_accuracy: float | None
    #: this epoch's throughput (all processes)
    samples_per_second: float
    #: throughput, MFU, peak memory and threads (:class:`paratrain.training.watch.RunWatch`)
    watched: dict[str, Any]
    #: ``time.perf_counter()`` when the loop started
    started: float
    #: where the epoch's time went (:meth:`LoopClock.end_epoch`), once its checkpoint is saved
    times: dict[str, Any] = field(default_factory=dict)


class LoopObserver:
    """One component watching the loop; every hook does nothing unless overridden.

    The loop calls the hooks on every process (an observer that writes only on the main
    process is built only there), in this order: ``running`` around the epochs, ``on_step``
    after each batch, ``on_epoch`` once an epoch is evaluated, ``on_epoch_saved`` after the
    epoch's checkpoint, and ``close`` once the run's files are written. A run stopped by a
    signal or an error leaves ``running`` by its exception and is not closed.
    """

    def running(self) -> AbstractContextManager[None]:
        """Entered before the first batch, left once training is done (or by an exception)."""
        return contextlib.nullcontext()

    def on_step(self, report: StepReport) -> None:
        """After each batch (a micro-batch while accumulating)."""

    def on_epoch(self, report: EpochReport) -> None:
        """The epoch's figures, before its checkpoint (which counts the lines written)."""

    def on_epoch_saved(self, report: EpochReport) -> None:
        """After the epoch's checkpoint (its time counts in the epoch's ``times``)."""

    def close(self) -> None:
        """The run's files are written: the final weights and ``config.json``."""


class Observers(LoopObserver):
    """The run's observers, each hook called on each of them in their order."""

    def __init__(self, members: Sequence[LoopObserver]) -> None:
        self.members = list(members)

    @contextlib.contextmanager
    def _all_running(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for member in self.members:
                stack.enter_context(member.running())
            yield

    def running(self) -> AbstractContextManager[None]:
        return self._all_running()

    def on_step(self, report: StepReport) -> None:
        for member in self.members:
            member.on_step(report)

    def on_epoch(self, report: EpochReport) -> None:
        for member in self.members:
            member.on_epoch(report)

    def on_epoch_saved(self, report: EpochReport) -> None:
        for member in self.members:
            member.on_epoch_saved(report)

    def close(self) -> None:
        for member in self.members:
            member.close()
