"""The bench's progress bar: one tick per measured run, on stderr; plain lines there
when stderr is not a terminal (a log file, CI), where a bar would show nothing."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

from paratrain.training.progress import stderr_progress


class BenchProgress:
    def __init__(self, enabled: bool) -> None:
        self._progress: Progress | None = None
        self._task = TaskID(0)
        self._lines = enabled and not sys.stderr.isatty()
        self._start = time.perf_counter()
        if enabled and not self._lines:
            self._progress = stderr_progress(
                TextColumn("[bold]bench"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
            )

    def __enter__(self) -> BenchProgress:
        if self._progress is not None:
            self._progress.start()
            self._task = self._progress.add_task("starting", total=None)
        return self

    def update(self, what: str, done: int, total: int) -> None:
        if self._lines:
            elapsed = time.perf_counter() - self._start
            print(f"bench: [{done}/{total}] {what} ({elapsed:.0f}s)", file=sys.stderr, flush=True)
        if self._progress is not None:
            self._progress.update(self._task, description=what, completed=done, total=total)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
