"""`paratrain bench loader`: which DataLoader ``num_workers`` x ``pin_memory`` feeds fastest.

For every setting it times the loader alone (batches fetched and copied to the device) and
the loader feeding real training steps; a step on a batch already in memory gives the speed
the model could reach with a free data path (timed window by window between the training
windows, so that the same load touches both). Workers persist across the data set's epochs,
so their start-up is paid once, before the timed windows, as in a long training run.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from paratrain.tools.bench.memory import synchronize
from paratrain.tools.bench.noise import within_noise
from paratrain.tools.bench.stats import Spread, spread
from paratrain.tools.bench.task import BenchTask

PIN_NOTE = "pin_memory speeds up copies to a CUDA GPU only: measured False alone here"


def worker_counts(limit: int | None = None) -> list[int]:
    """0, 1, 2, 4, 8... up to ``limit`` (default: the number of cores)."""
    limit = os.cpu_count() or 1 if limit is None else limit
    counts, n = [0], 1
    while n <= limit:
        counts.append(n)
        n *= 2
    return counts


@dataclass(frozen=True)
class LoaderSetting:
    num_workers: int
    pin_memory: bool

    @property
    def label(self) -> str:
        return f"num_workers={self.num_workers}, pin_memory={self.pin_memory}"


@dataclass
class LoaderRow:
    setting: LoaderSetting
    #: batches per second of the loader alone, and of the loader feeding training steps
    loader: Spread
    training: Spread

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_workers": self.setting.num_workers,
            "pin_memory": self.setting.pin_memory,
            "loader_batches_per_second": self.loader.to_dict(),
            "training_batches_per_second": self.training.to_dict(),
        }


@dataclass
class LoaderReport:
    device: str
    batch_size: int
    batches: int
    rows: list[LoaderRow]
    #: training steps per second on one batch kept in memory: the ceiling of any loader
    step_alone: Spread
    recommended: LoaderSetting
    bottleneck: bool
    message: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "batch_size": self.batch_size,
            "batches": self.batches,
            "rows": [row.to_dict() for row in self.rows],
            "step_alone_batches_per_second": self.step_alone.to_dict(),
            "recommended": {
                "num_workers": self.recommended.num_workers,
                "pin_memory": self.recommended.pin_memory,
            },
            "data_path_is_bottleneck": self.bottleneck,
            "message": self.message,
            "notes": self.notes,
        }


def _cycle(loader: DataLoader[Any]) -> Iterator[Any]:
    """Batches without end: a small data set is gone through again (workers persist)."""
    while True:
        yield from loader


def _to(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device, non_blocking) for k, v in batch.items()}
    return batch


def _windows(
    work: Callable[[], Any], device: torch.device, batches: int, warmup: int, repeats: int
) -> Spread:
    """Batches per second of ``work`` (one batch a call) over ``repeats`` timed windows."""
    for _ in range(warmup):
        work()
    rates = []
    for _ in range(repeats):
        synchronize([device])
        start = time.perf_counter()
        for _ in range(batches):
            work()
        synchronize([device])
        rates.append(batches / max(time.perf_counter() - start, 1e-9))
    return spread(rates)


class _Step:
    """One training step (forward, loss, backward, optimizer step) on a batch."""

    def __init__(self, task: BenchTask, device: torch.device) -> None:
        self.model = task.model.to(device).train()
        self.optimizer = task.make_optimizer(self.model.parameters())
        self.loss_fn = task.loss_fn

    def __call__(self, batch: Any) -> None:
        inputs, targets = batch[0], batch[1]
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_fn(self.model(inputs), targets).backward()
        self.optimizer.step()


def measure_loader(
    task: BenchTask,
    device: torch.device,
    batch_size: int,
    batches: int = 30,
    warmup: int = 3,
    repeats: int = 3,
    max_workers: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> LoaderReport:
    """Sweep ``num_workers`` x ``pin_memory`` and recommend a setting."""
    notes = []
    pins = [False, True] if device.type == "cuda" else [False]
    if device.type != "cuda":
        notes.append(PIN_NOTE)
    step = _Step(task, device)
    # The ceiling: steps on one batch already on the device, no loader at all. Timed in
    # windows interleaved with every setting's training windows (a change in the machine's
    # load touches both alike), after the same warm-up.
    first = next(iter(DataLoader(task.dataset, batch_size=batch_size, shuffle=True)))
    resident = _to(first, device, False)
    timing = (batches, warmup, repeats)
    rows, alone = [], []
    for workers, pin in itertools.product(worker_counts(max_workers), pins):
        setting = LoaderSetting(workers, pin)
        if progress is not None:
            progress(setting.label)
        row, resident_rates = _measure_setting(
            task, step, resident, device, setting, batch_size, timing
        )
        rows.append(row)
        alone += resident_rates
    step_alone = spread(alone)
    recommended, bottleneck, message = recommend(rows, step_alone)
    if any(row.training.median > step_alone.max for row in rows):
        notes.append(
            "training through a loader measured faster than the best window from memory, "
            "which does less work: these figures are noise-bound (a busy machine?); rerun "
            "with more --batches"
        )
    return LoaderReport(
        str(device), batch_size, batches, rows, step_alone, recommended, bottleneck, message, notes
    )


def _measure_setting(
    task: BenchTask,
    step: _Step,
    resident: Any,
    device: torch.device,
    setting: LoaderSetting,
    batch_size: int,
    timing: tuple[int, int, int],
) -> tuple[LoaderRow, list[float]]:
    """The setting's row, and the from-memory rates timed between its training windows."""
    batches, warmup, repeats = timing
    loader = DataLoader(
        task.dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=setting.num_workers,
        pin_memory=setting.pin_memory,
        persistent_workers=setting.num_workers > 0,
    )
    source = _cycle(loader)  # its workers stop when this function returns

    def fetch() -> Any:
        return _to(next(source), device, setting.pin_memory)

    loader_rate = _windows(fetch, device, *timing)
    for _ in range(warmup):  # warm, as training is
        step(resident)
    training, alone = [], []
    for _ in range(repeats):  # interleaved, window by window
        alone.append(_windows(lambda: step(resident), device, batches, 0, 1).median)
        training.append(_windows(lambda: step(fetch()), device, batches, 0, 1).median)
    return LoaderRow(setting, loader_rate, spread(training)), alone


def recommend(rows: list[LoaderRow], step_alone: Spread) -> tuple[LoaderSetting, bool, str]:
    """(setting, is the data path the bottleneck, one sentence), read off the table itself.

    The fastest training rate wins; settings within the noise of it
    (:func:`paratrain.tools.bench.noise.within_noise`) are a tie, and the cheapest of those
    (fewest workers, no pinning) is recommended. The data path is not the bottleneck of the
    recommended setting when training with it runs within 10% of steps on a batch kept in
    memory (the ceiling), or its loader alone delivers batches twice as fast as that.
    """
    best = max(rows, key=lambda r: r.training.median)
    ties = [r for r in rows if r is best or within_noise(best.training, r.training)]
    chosen = min(ties, key=lambda r: (r.setting.num_workers, r.setting.pin_memory))
    ceiling = step_alone.median
    reaches_ceiling = chosen.training.median >= 0.9 * ceiling
    bottleneck = not (chosen.loader.median >= 2 * ceiling or reaches_ceiling)
    tie = f" (tied with {len(ties) - 1} other setting(s) within the noise)" if len(ties) > 1 else ""
    cheaper = [r for r in rows if r.setting.num_workers < chosen.setting.num_workers]
    slower = ""
    if cheaper:
        worst = min(cheaper, key=lambda r: r.training.median)
        slower = (
            f"; fewer workers train slower ({worst.setting.label}: "
            f"{worst.training.median:,.1f} batches/s)"
        )
    if not bottleneck:
        message = (
            f"use {chosen.setting.label}{tie}: {chosen.training.median:,.1f} training "
            f"batches/s against {ceiling:,.1f}/s for steps on a batch kept in memory; with it "
            f"the data path is not the bottleneck, so more workers would not train faster{slower}"
        )
    else:
        message = (
            f"use {chosen.setting.label}{tie}: {chosen.training.median:,.1f} training "
            f"batches/s, against {ceiling:,.1f}/s for steps on a batch kept in memory; the "
            f"data path limits training{slower}"
        )
    return chosen.setting, bottleneck, message
