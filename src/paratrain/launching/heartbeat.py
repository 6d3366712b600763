"""Each rank's sign of life, for the launcher's hang watchdog (:mod:`paratrain.launching.watchdog`).

A launcher that watches its processes sets ``PARATRAIN_HEARTBEAT_DIR``. Each rank then keeps
a 40-byte memory-mapped file there, ``beat-rank{R}``: its pid, how many beats it has made,
the time of the last one (``time.monotonic()``: one clock for every process of the machine,
which a wall-clock step by NTP does not move, so a step is never taken for a hang), and
whether it is waiting for its peers (in a step's collectives, see :func:`waiting`), and a
CRC-32 of those four. :func:`beat` rewrites the bytes in place with one copy: no system call,
about a microsecond, so it can sit in every training step. The launcher reads the file while
the rank writes it: a record whose checksum does not match was read half-written, and is read
again (or skipped for this look), never taken for a beat at time 0. The runtime beats in
``rt.backward``, in every collective and for every batch a loader delivers.

:func:`arm` also registers :mod:`faulthandler` on ``SIGUSR2``: the watchdog sends it to a
stuck rank, which then writes every thread's Python stack to ``stack-rank{R}.txt``, even when
its main thread is blocked inside a C call such as a collective.

Every 64 beats a rank also checks that its launcher is still alive, and exits if not
(:mod:`paratrain.launching.parent_death`; on Linux the kernel kills it anyway).
"""

from __future__ import annotations

import contextlib
import faulthandler
import mmap
import os
import signal
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from paratrain.utils import environment
from paratrain.utils.atomic import atomic_write_text

DIRECTORY_VARIABLE = environment.HEARTBEAT_DIR_VARIABLE
_LAYOUT = struct.Struct("<qqdq")  # pid, beats, time of the last beat, waiting (0/1)
_CHECK = struct.Struct("<Q")  # CRC-32 of the fields above
_SIZE = _LAYOUT.size + _CHECK.size
#: reads of a record caught half-written before it is skipped for this look
_READ_TRIES = 8
#: beats between two checks that the launcher is still alive (one system call each)
_PARENT_CHECK_EVERY = 64


@dataclass(frozen=True)
class Beat:
    """What a rank's heartbeat file says."""

    rank: int
    pid: int
    count: int
    time: float
    #: inside a step's collectives: most likely waiting for a stuck peer
    waiting: bool


def encode(pid: int, count: int, when: float, waiting: int) -> bytes:
    """One heartbeat record, as a rank writes it."""
    fields = _LAYOUT.pack(pid, count, when, waiting)
    return fields + _CHECK.pack(zlib.crc32(fields))


def decode(record: bytes) -> tuple[int, int, float, int] | None:
    """The fields of a record, or None if it was read half-written (or is no record)."""
    if len(record) < _SIZE:
        return None
    fields, (check,) = record[: _LAYOUT.size], _CHECK.unpack(record[_LAYOUT.size : _SIZE])
    if zlib.crc32(fields) != check:
        return None
    pid, count, when, waiting = _LAYOUT.unpack(fields)
    return pid, count, when, waiting


def beat_file(directory: Path, rank: int) -> Path:
    return directory / f"beat-rank{rank}"


def stack_file(directory: Path, rank: int) -> Path:
    return directory / f"stack-rank{rank}.txt"


def place_file(directory: Path, rank: int) -> Path:
    return directory / f"place-rank{rank}.txt"


class _Heart:
    def __init__(self, directory: Path, rank: int) -> None:
        path = beat_file(directory, rank)
        path.write_bytes(encode(os.getpid(), 0, time.monotonic(), 0))
        with open(path, "r+b") as handle:
            self.map = mmap.mmap(handle.fileno(), _SIZE)
        self.directory, self.rank = directory, rank
        self.pid = os.getpid()
        self.parent = os.getppid()
        self.count = 0
        # Kept open for the process's life: faulthandler writes to its descriptor.
        self.stack: IO[str] = open(stack_file(directory, rank), "w")  # noqa: SIM115
        if hasattr(signal, "SIGUSR2"):
            faulthandler.register(signal.SIGUSR2, file=self.stack, all_threads=True)

    def beat(self, waiting: int = 0) -> None:
        self.count += 1
        if self.count % _PARENT_CHECK_EVERY == 0 and os.getppid() != self.parent:
            # The launcher is gone (where no kernel signal told us): do not train on alone.
            os._exit(1)
        # One copy of a record built aside: ``pack_into`` zeroes the record before it
        # fills it in, and a reader then saw a beat at time 0 (silence since boot).
        self.map[:_SIZE] = encode(self.pid, self.count, time.monotonic(), waiting)


_heart: _Heart | None = None
_checked = False


def arm(rank: int | None = None) -> bool:
    """Start this rank's heartbeat if a launcher watches (``PARATRAIN_HEARTBEAT_DIR``).

    Called as early as possible in each process, so that a rank stuck before its first
    beat can still show its stack. Idempotent; returns whether the heartbeat runs.
    """
    global _heart, _checked
    _checked = True
    if _heart is not None and _heart.pid == os.getpid():
        return True
    env = environment.current()
    if env.heartbeat_dir is None:
        return False
    _heart = _Heart(env.heartbeat_dir, env.rank if rank is None else rank)
    return True


def announce_place(place: str) -> None:
    """This rank's coordinates in a two-dimensional layout (``"replicate 1, shard 0"``), for
    the watchdog's report; nothing for ``""`` or unwatched."""
    if place and _heart is not None:
        atomic_write_text(place_file(_heart.directory, _heart.rank), place)


def beat() -> None:
    """This rank made progress (no-op unless a launcher watches)."""
    if _heart is not None:
        _heart.beat()
    elif not _checked:
        arm()
        if _heart is not None:
            _heart.beat()


def waiting() -> contextlib.AbstractContextManager[None]:
    """Around work that waits for the other ranks (a step's backward and collectives): the
    watchdog then blames a rank that is not waiting. Unwatched, a shared do-nothing context:
    it sits in every training step."""
    if _heart is None and _checked:  # unwatched: nothing to tell
        return _NOTHING
    beat()
    return _NOTHING if _heart is None else _waiting(_heart)


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _waiting(heart: _Heart) -> Iterator[None]:
    heart.beat(waiting=1)
    try:
        yield
    finally:
        heart.beat()


def read_beats(directory: Path) -> list[Beat]:
    """Every rank's last heartbeat found in ``directory``, in rank order."""
    beats = []
    for path in directory.glob("beat-rank*"):
        fields = _read_record(path)
        if fields is None:
            continue
        pid, count, when, wait = fields
        rank = int(path.name.removeprefix("beat-rank"))
        beats.append(Beat(rank, pid, count, when, bool(wait)))
    return sorted(beats, key=lambda b: b.rank)


def _read_record(path: Path) -> tuple[int, int, float, int] | None:
    """A whole record of ``path``: read again while the rank is caught writing it; None if
    it never reads whole (the next look will), or the file is gone."""
    for _ in range(_READ_TRIES):
        try:
            fields = decode(path.read_bytes())
        except OSError:
            return None
        if fields is not None:
            return fields
        time.sleep(0)  # let the writer finish its copy
    return None
