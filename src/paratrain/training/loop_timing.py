"""Where the training loop's time goes: the first batch (compiling, warming up), steady
training, evaluation and checkpoints.

The clock waits for the device at each phase boundary (a few times per epoch), so queued GPU
work is counted in the phase that queued it. ``steady`` throughput leaves out the first
batch, evaluation and checkpoints; later recompiles (the uneven last batch's, once) stay in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.runtime.compiling import compile_counts

PHASES = ("eval", "checkpoint")


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class LoopTimes:
    """The run's timing figures, as the summary reports them."""

    first_batch_seconds: float = 0.0
    compiled_graphs: int = 0
    compile_seconds: float = 0.0
    steady_samples_per_second: float = 0.0
    eval_seconds: float = 0.0
    checkpoint_seconds: float = 0.0

    def line(self, seconds: float) -> str:
        """``; first batch 9.1s (2 graphs compiled in 8.7s), then 1,234 samples/s; evaluation
        2.0% and checkpoints 0.4% of the time``."""
        compiled = ""
        if self.compiled_graphs:
            compiled = f" ({self.compiled_graphs} graph(s) compiled in {self.compile_seconds:.1f}s)"
        share = max(seconds, 1e-9)
        return (
            f"; first batch {self.first_batch_seconds:.2f}s{compiled}, then "
            f"{self.steady_samples_per_second:,.0f} samples/s; evaluation "
            f"{self.eval_seconds / share:.1%} and checkpoints "
            f"{self.checkpoint_seconds / share:.1%} of the time"
        )


class LoopClock:
    """Times the phases of one run of the training loop, in one process."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        synchronize(device)
        self.start = time.perf_counter()
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._epoch = dict.fromkeys(PHASES, 0.0)
        self._epoch_start = self.start
        self._first: tuple[float, int] | None = None  # (seconds, samples) of the first batch
        self._graphs, self._compile_seconds = compile_counts()

    @contextlib.contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        synchronize(self.device)
        begin = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            elapsed = time.perf_counter() - begin
            self.totals[phase] += elapsed
            self._epoch[phase] += elapsed

    def batch_done(self, samples: int) -> None:
        """After every batch; ``samples``: trained so far in this run (all processes)."""
        if self._first is None:
            synchronize(self.device)
            self._first = (time.perf_counter() - self.start, samples)

    def end_epoch(self, epoch: int, step: int) -> dict[str, Any]:
        """The epoch's record for ``timings.jsonl``; starts the next epoch's."""
        now = time.perf_counter()
        record = {
            "epoch": epoch,
            "step": step,
            "seconds": now - self._epoch_start,
            **{f"{phase}_seconds": self._epoch[phase] for phase in PHASES},
        }
        self._epoch = dict.fromkeys(PHASES, 0.0)
        self._epoch_start = now
        return record

    def times(self, samples: int) -> LoopTimes:
        """The run's figures once training is done; ``samples``: trained in this run."""
        synchronize(self.device)
        elapsed = time.perf_counter() - self.start
        first_seconds, first_samples = self._first or (0.0, 0)
        training = elapsed - sum(self.totals.values()) - first_seconds
        graphs, compile_seconds = compile_counts()
        return LoopTimes(
            first_batch_seconds=first_seconds,
            compiled_graphs=graphs - self._graphs,
            compile_seconds=compile_seconds - self._compile_seconds,
            steady_samples_per_second=(samples - first_samples) / max(training, 1e-9),
            eval_seconds=self.totals["eval"],
            checkpoint_seconds=self.totals["checkpoint"],
        )
