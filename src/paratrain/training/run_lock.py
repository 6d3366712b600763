"""One run at a time writes a run directory.

``RUN/.paratrain-lock`` holds the owner's host and pid while a run (or a resume of it)
writes the directory::

    lock = acquire(run_dir)   # UserError if a live process holds it
    ...
    lock.release()            # or: with hold(run_dir): ...

A lock whose owner is gone (the same host, no such process) is stale: it is taken over,
with a note. A lock file appears whole (written aside, then linked into place), and a
takeover happens under an advisory lock on the directory, where the taker looks again: two
processes taking over the same stale lock at once end with one owner. A lock held by another
host cannot be checked from here and is refused with the owner named; its file may be removed
by hand once that run is known to be gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from paratrain.launching.parent_death import process_exists
from paratrain.utils.errors import UserError

LOCK = ".paratrain-lock"


class RunLock:
    """A held lock; :meth:`release` removes its file (idempotent)."""

    def __init__(self, path: Path, created: tuple[Path, ...] = ()) -> None:
        self.path = path
        self.held = True
        #: the directories acquiring created, innermost first: removed again if left empty
        self.created = created

    def release(self) -> None:
        if self.held:
            self.held = False
            owner = _read(self.path)
            if owner is not None and _is_mine(owner):
                self.path.unlink(missing_ok=True)
            for directory in self.created:  # a run refused before it wrote anything
                try:
                    directory.rmdir()
                except OSError:
                    break

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(run_dir: str | Path) -> RunLock:
    """Lock ``run_dir`` (created if absent) for this process, or raise ``UserError`` naming
    the live owner. Takes over, with a note on stderr, a lock whose owner is gone."""
    directory = Path(run_dir)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory} is a file, not a directory; choose another --out")
    created = tuple(d for d in (directory, *directory.parents) if not d.exists())
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {directory}: {exc.strerror}") from None
    path = directory / LOCK
    me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()})
    for _ in range(3):  # another process may take the lock, or release it, meanwhile
        if _publish(directory, path, me):
            return RunLock(path, created)
        owner = _read(path)
        if owner is not None and _is_mine(owner):
            return RunLock(path, created)
        if owner is not None and _alive(owner):
            raise UserError(_refusal(directory, owner))
        if _take_over(directory, path, owner, me):
            return RunLock(path, created)
    raise UserError(f"cannot lock {directory}: other processes keep taking its lock")


def _publish(directory: Path, path: Path, record: str) -> bool:
    """Create the lock file holding ``record``, whole; False if a lock file exists."""
    aside = path.with_name(f"{LOCK}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        aside.write_text(record, encoding="utf-8")
        os.link(aside, path)  # fails if the lock exists: one process creates it
    except FileExistsError:
        return False
    except OSError as exc:  # a full disk, a folder not writable
        raise UserError(f"cannot lock {directory}: {exc.strerror or exc}") from None
    finally:
        aside.unlink(missing_ok=True)
    return True


def _take_over(directory: Path, path: Path, stale: dict[str, Any] | None, record: str) -> bool:
    """Replace the stale lock ``stale`` (None: unreadable) with ``record``: one process at a
    time, each looking again first, so that a lock another taker just created is not removed
    as the stale one. False if the lock changed meanwhile."""
    with _directory_locked(directory):
        if _read(path) != stale:
            return False  # taken over, or released, by another process meanwhile
        owner = stale or {}
        if path.exists():  # (released meanwhile: nothing to take over)
            print(
                f"paratrain: note: {directory} was locked by pid {owner.get('pid')} on "
                f"{owner.get('host')}, which is gone; taking the lock over",
                file=sys.stderr,
            )
        path.unlink(missing_ok=True)
        return _publish(directory, path, record)


@contextlib.contextmanager
def _directory_locked(directory: Path) -> Iterator[None]:
    """An advisory lock on the run directory itself (no file left behind), for takeovers."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        raise UserError(f"cannot lock {directory}: {exc.strerror or exc}") from None
    try:
        with contextlib.suppress(OSError):  # no advisory locks here: the look again still helps
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the advisory lock


def refuse_if_held(run_dir: str | Path) -> None:
    """Raise ``UserError`` naming the live owner if another process holds ``run_dir``'s
    lock: checked before anything reads the run, whose files that owner is changing."""
    owner = _read(Path(run_dir) / LOCK)
    if owner is not None and not _is_mine(owner) and _alive(owner):
        raise UserError(_refusal(Path(run_dir), owner))


@contextlib.contextmanager
def hold(run_dir: str | Path) -> Iterator[RunLock]:
    lock = acquire(run_dir)
    try:
        yield lock
    finally:
        lock.release()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _is_mine(owner: dict[str, Any]) -> bool:
    return owner.get("host") == socket.gethostname() and owner.get("pid") == os.getpid()


def _alive(owner: dict[str, Any]) -> bool:
    """Whether the owner may still run: unknowable on another host (assumed alive)."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname():
        return bool(owner.get("host"))
    if not isinstance(pid, int) or pid <= 0:
        return False
    return process_exists(pid) and not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _refusal(directory: Path, owner: dict[str, Any]) -> str:
    host, pid = owner.get("host"), owner.get("pid")
    if host != socket.gethostname():
        return (
            f"{directory} is locked by pid {pid} on host {host}; wait for that run to end, or "
            f"remove {directory / LOCK} if it is gone"
        )
    return (
        f"{directory} is in use by another run (pid {pid} on this machine); wait for it to end "
        "or stop it first"
    )
