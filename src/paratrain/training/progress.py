"""A progress bar with loss and throughput, shown by the main process only."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


def stderr_progress(*columns: ProgressColumn) -> Progress:
    """A transient progress bar on stderr (stdout stays for results), elapsed time last."""
    return Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True)


class TrainProgress:
    """Updated at most a few times a second, so it never slows the loop down."""

    def __init__(self, total_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task = TaskID(0)
        self._total = total_steps
        self._last_refresh = 0.0
        self._start = time.perf_counter()
        #: samples/s -> model FLOPs utilisation, once the loop knows it
        self.mfu_of: Callable[[float], float | None] | None = None
        if enabled:
            self._progress = stderr_progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[speed]} samples/s"),
                TextColumn("{task.fields[mfu]}"),
            )

    def __enter__(self) -> TrainProgress:
        if self._progress is not None:
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=self._total, loss="-", speed="-", mfu=""
            )
        return self

    def due(self) -> bool:
        """Whether an update would be shown now (callers skip reading the loss otherwise)."""
        return self.enabled and time.perf_counter() - self._last_refresh > 0.25

    def update(self, step: int, epoch: int, loss: float | None, samples: int) -> None:
        if self._progress is None:
            return
        self._last_refresh = now = time.perf_counter()
        speed = samples / max(now - self._start, 1e-9)
        mfu = self.mfu_of(speed) if self.mfu_of is not None else None
        self._progress.update(
            self._task,
            completed=step,
            description=f"epoch {epoch}",
            loss="-" if loss is None else f"{loss:.4f}",
            speed=f"{speed:,.0f}",
            mfu="" if mfu is None else f"MFU {mfu:.1%}",
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
