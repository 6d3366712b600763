"""The launcher's hang watchdog: stops a run whose ranks stopped making progress.

Each rank beats (:mod:`paratrain.launching.heartbeat`). When a rank's last beat is older than the
hang
timeout, the watchdog blames the rank that is *behind*: the one with the fewest beats (ties:
the oldest beat), preferring ranks that are not inside a step's collectives. A rank that
sleeps, or whose data ran out while the others wait for it in a collective, has stopped
first, outside a collective; the others are blocked inside one. The blamed rank gets
``SIGUSR2`` and writes its Python stack (faulthandler); then every rank is killed, and the
error carries that stack.

A rank is watched from its first beat on: joining the group has its own timeout
(``PARATRAIN_INIT_TIMEOUT``), and startup (imports, data) may take long. Each launcher
watches the ranks of its own machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from paratrain.launching.heartbeat import Beat, place_file, read_beats, stack_file
from paratrain.launching.parent_death import process_exists
from paratrain.utils import environment
from paratrain.utils.errors import UserError

TIMEOUT_VARIABLE = "PARATRAIN_HANG_TIMEOUT"
#: seconds; well below the 1800 s collective timeout, above a slow first step
DEFAULT_TIMEOUT = 600.0
POLL_SECONDS = 0.25
#: how long the stuck rank gets to write its stack
_DUMP_SECONDS = 5.0
#: polls (0.1 s apart) a stack must stay the same size to be complete
_STILL_POLLS = 5


def hang_timeout() -> float | None:
    """``PARATRAIN_HANG_TIMEOUT`` in seconds (default 600); None when it is 0 (off)."""
    raw = environment.current().get(TIMEOUT_VARIABLE)
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise UserError(
            f"{TIMEOUT_VARIABLE}={raw!r} (--hang-timeout) must be a number of seconds, 0 for off"
        )
    return seconds or None


@dataclass(frozen=True)
class Hang:
    """A stuck rank: who (and where in a two-dimensional layout), since when, and its
    Python stack."""

    rank: int
    pid: int
    seconds: float
    stack: str
    place: str = ""

    def message(self) -> str:
        stack = self.stack.strip() or "(it wrote no stack)"
        where = f"; {self.place}" if self.place else ""
        return (
            f"rank {self.rank} (pid {self.pid}{where}) made no progress for {self.seconds:.0f}s "
            f"(--hang-timeout / {TIMEOUT_VARIABLE}); every process was stopped. "
            f"Its Python stack:\n{stack}"
        )


class Watchdog:
    """Watches the heartbeats in ``directory``; :meth:`check` returns a :class:`Hang`."""

    def __init__(self, directory: Path, timeout: float) -> None:
        self.directory = directory
        self.timeout = timeout

    def _living(self) -> list[Beat]:
        # Files of processes that are gone (an earlier attempt of an elastic run) are stale.
        return [b for b in read_beats(self.directory) if process_exists(b.pid)]

    def check(self) -> Hang | None:
        """If a watched rank is stuck: dump its stack, kill every rank, describe it."""
        beats = self._living()
        now = time.monotonic()  # the beats' clock: one for the machine, not moved by NTP
        late = [b for b in beats if b.count > 0 and now - b.time > self.timeout]
        if not late:
            return None
        stuck = min(beats, key=lambda b: (b.waiting, b.count, b.time))
        seconds = now - (stuck.time if stuck.count > 0 else min(b.time for b in late))
        stack = self._dump(stuck)
        for other in beats:
            with contextlib.suppress(ProcessLookupError):
                os.kill(other.pid, signal.SIGKILL)
        return Hang(stuck.rank, stuck.pid, seconds, stack, self._place(stuck))

    def _place(self, stuck: Beat) -> str:
        path = place_file(self.directory, stuck.rank)
        return path.read_text(errors="replace").strip() if path.exists() else ""

    def _dump(self, stuck: Beat) -> str:
        path = stack_file(self.directory, stuck.rank)
        if hasattr(signal, "SIGUSR2"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck.pid, signal.SIGUSR2)
            # faulthandler writes from its signal handler at once, but a loaded machine can
            # pause it between two writes for longer than a poll: done when the stack ends a
            # line and has not grown for _STILL_POLLS polls in a row.
            deadline, size, still = time.monotonic() + _DUMP_SECONDS, -1, 0
            while time.monotonic() < deadline and still < _STILL_POLLS:
                time.sleep(0.1)
                now = path.stat().st_size if path.exists() else 0
                still = still + 1 if now > 0 and now == size and _ends_a_line(path) else 0
                size = now
        return path.read_text(errors="replace") if path.exists() else ""


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as stack:
        stack.seek(-1, os.SEEK_END)
        return stack.read(1) == b"\n"


class WatchdogThread:
    """The watchdog in a background thread, for a launcher that blocks (torchrun's agent)."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog
        self.hang: Hang | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratrain-watchdog", daemon=True)

    def __enter__(self) -> WatchdogThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def finish(self) -> Hang | None:
        """Stop watching, after the look in progress: the hang it found, or None.

        The look kills the ranks before it returns the hang, so the launcher can see them
        dead first (a busy machine leaves this thread waiting for a core); read ``hang``
        through this, not before."""
        self._stop.set()
        self._thread.join()
        return self.hang

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            hang = self.watchdog.check()
            if hang is not None:
                self.hang = hang  # the last one: an elastic agent may restart after it
