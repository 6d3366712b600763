"""The runner and a worker's processes agree on each timed window through files.

A worker starts once per combination and stays: it warms up, says it is ready, then times
one window each time the runner asks (``go-N``) until the runner says ``stop``. So the
runner can interleave the combinations window by window (a change in the machine's load
touches them all alike) and stop clear losers early, without paying a process start per
repeat. Files, not pipes: every process of a group (ddp's ranks) reads the same request.

Nobody polls. Whoever waits blocks on a doorbell (a FIFO in the same folder) that the other
side rings after writing its file: a window is timed while every other process of the bench
sleeps. (Idle workers that looked for their request every 10 ms, and a runner that looked
for the result as often, cost one-process layouts with two spinning threads 6-9% of their
samples/s on 2 cores, and made them vary twice as much.) Where FIFOs do not exist, waiting
falls back to looking every ``POLL_SECONDS``.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from pathlib import Path

from paratrain.launching.heartbeat import beat

STOP = "stop"
#: without FIFOs: how often a waiting process looks (not part of any timed window)
POLL_SECONDS = 0.01
#: the longest a waiting process sleeps: it beats for the launcher's watchdog, and the
#: runner checks that its worker is alive
WAKE_SECONDS = 1.0
RUNNER_BELL = "runner.bell"


def _write(path: Path, text: str) -> None:
    """Whole or absent for the reader (a rename); no fsync: nothing here outlives the run."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class Doorbell:
    """A FIFO its owner waits on; :func:`ring` wakes it. The owner holds it open for reading
    and writing, so it never reads an end of file and a ring before the wait is kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        if hasattr(os, "mkfifo"):
            with contextlib.suppress(OSError):
                os.mkfifo(path)
                self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def wait(self, seconds: float) -> None:
        """Sleep until rung or ``seconds`` passed (without a FIFO: at most POLL_SECONDS)."""
        if self._fd is None:
            time.sleep(min(seconds, POLL_SECONDS))
            return
        readable, _, _ = select.select([self._fd], [], [], max(0.0, seconds))
        if readable:
            with contextlib.suppress(BlockingIOError):
                os.read(self._fd, 4096)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def ring(path: Path) -> None:
    """Wake the owner of the doorbell at ``path``; nothing if it has none or is gone."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no such FIFO (polling), or nobody holds it open any more
        return
    try:
        os.write(fd, b"!")
    except OSError:  # full: it has been rung already
        pass
    finally:
        os.close(fd)


def request_path(out_dir: Path, window: int) -> Path:
    return out_dir / f"go-{window}"


def ready_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank}.ready"


def window_path(out_dir: Path, rank: int, window: int) -> Path:
    return out_dir / f"rank{rank}.window{window}"


def bell_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank}.bell"


# -- the worker's side ---------------------------------------------------------------------------
class Requests:
    """One process of a worker: says it is ready, waits for each request, reports each
    window's seconds."""

    def __init__(self, out_dir: Path, rank: int) -> None:
        self.out_dir, self.rank = out_dir, rank
        self.bell = Doorbell(bell_path(out_dir, rank))  # before "ready": no ring is missed

    def say_ready(self) -> None:
        _write(ready_path(self.out_dir, self.rank), "ready\n")
        ring(self.out_dir / RUNNER_BELL)

    def next(self, window: int) -> bool:
        """Wait until the runner asks for window ``window`` (True) or says stop (False)."""
        while True:
            if request_path(self.out_dir, window).exists():
                return True
            if (self.out_dir / STOP).exists():
                self.bell.close()
                return False
            beat()  # waiting for the runner is no hang: the launcher's watchdog must not stop it
            self.bell.wait(WAKE_SECONDS)

    def report(self, window: int, seconds: float) -> None:
        _write(window_path(self.out_dir, self.rank, window), f"{seconds!r}\n")
        ring(self.out_dir / RUNNER_BELL)


# -- the runner's side ---------------------------------------------------------------------------
def _ring_all(out_dir: Path, processes: int) -> None:
    for rank in range(processes):
        ring(bell_path(out_dir, rank))


def ask_window(out_dir: Path, window: int, processes: int) -> None:
    _write(request_path(out_dir, window), "go\n")
    _ring_all(out_dir, processes)


def ask_stop(out_dir: Path, processes: int) -> None:
    _write(out_dir / STOP, "stop\n")
    _ring_all(out_dir, processes)


def all_ready(out_dir: Path, processes: int) -> bool:
    return all(ready_path(out_dir, rank).exists() for rank in range(processes))


def window_seconds(out_dir: Path, processes: int, window: int) -> float | None:
    """The window's time once every process timed it (a group is as slow as its slowest
    process), else None."""
    paths = [window_path(out_dir, rank, window) for rank in range(processes)]
    if not all(p.exists() for p in paths):
        return None
    return max(float(p.read_text(encoding="utf-8")) for p in paths)
