"""The runner and a worker's processes agree on each timed window through files.

A worker starts once per combination and stays: it warms up, says it is ready, then times
one window each time the runner asks (``go-N``) until the runner says ``stop``. So the
runner can interleave the combinations window by window (a change in the machine's load
touches them all alike) and stop clear losers early, without paying a process start per
repeat. Files, not pipes: every process of a group (ddp's ranks) reads the same request.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from paratrain.launching.heartbeat import beat

STOP = "stop"
#: how often a waiting process looks for the next request (not part of any timed window)
POLL_SECONDS = 0.01


def _write(path: Path, text: str) -> None:
    """Whole or absent for the reader (a rename); no fsync: nothing here outlives the run."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def request_path(out_dir: Path, window: int) -> Path:
    return out_dir / f"go-{window}"


def ready_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank}.ready"


def window_path(out_dir: Path, rank: int, window: int) -> Path:
    return out_dir / f"rank{rank}.window{window}"


# -- the worker's side ---------------------------------------------------------------------------
def say_ready(out_dir: Path, rank: int) -> None:
    _write(ready_path(out_dir, rank), "ready\n")


def next_request(out_dir: Path, window: int) -> bool:
    """Wait until the runner asks for window ``window`` (True) or says stop (False)."""
    while True:
        if request_path(out_dir, window).exists():
            return True
        if (out_dir / STOP).exists():
            return False
        beat()  # waiting for the runner is no hang: the launcher's watchdog must not stop it
        time.sleep(POLL_SECONDS)


def report_window(out_dir: Path, rank: int, window: int, seconds: float) -> None:
    _write(window_path(out_dir, rank, window), f"{seconds!r}\n")


# -- the runner's side ---------------------------------------------------------------------------
def ask_window(out_dir: Path, window: int) -> None:
    _write(request_path(out_dir, window), "go\n")


def ask_stop(out_dir: Path) -> None:
    _write(out_dir / STOP, "stop\n")


def all_ready(out_dir: Path, processes: int) -> bool:
    return all(ready_path(out_dir, rank).exists() for rank in range(processes))


def window_seconds(out_dir: Path, processes: int, window: int) -> float | None:
    """The window's time once every process timed it (a group is as slow as its slowest
    process), else None."""
    paths = [window_path(out_dir, rank, window) for rank in range(processes)]
    if not all(p.exists() for p in paths):
        return None
    return max(float(p.read_text(encoding="utf-8")) for p in paths)
