"""Crash-safe file writes: a file is either complete under its name, or absent.

A full disk is said in one line, ``no space left on device while writing PATH: N bytes
needed, M free`` (a :class:`DiskFull`, an ``OSError`` with ``errno.ENOSPC``), and leaves
nothing half-written: the temporary file goes, the previous file under the name stays.
Where the size is known beforehand (``size``), the free space is checked before anything
is written; a disk that fills up during the write says ``more than the M bytes free are
needed`` (M: the free space once the part written is gone).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

#: errors that mean the file system is full (or the user's quota is)
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
#: below this much free space, a writer's failure (torch's says "unexpected pos") is taken
#: to be the disk being full
_NEARLY_FULL = 1 << 20


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (no-op where directories can't be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (``os.umask`` sets it
    too, which would race with a checkpoint written by a background thread)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def free_bytes(directory: Path) -> int | None:
    """Free space for this user under ``directory``, None where it cannot be told."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


class DiskFull(OSError):
    """A full disk (``errno.ENOSPC``, or ``EDQUOT``: a full quota), said in one line; keeps
    the figures, so that a caller can say it again of what it was writing (a checkpoint
    rather than one of its files)."""

    path: Path
    #: bytes the write takes (``at_least``: the bytes written when the disk was full)
    needed: int
    at_least: bool
    free: int | None


def full_headline(code: int | None) -> str:
    """How a full disk's one line starts: the disk, or the user's quota on it (``EDQUOT``)."""
    return "disk quota exceeded" if code == errno.EDQUOT else "no space left on device"


def make_room(code: int | None) -> str:
    """What to do about it: free space on that disk, or under the quota."""
    if code == errno.EDQUOT:
        return "free space under your quota on that disk (or have the quota raised)"
    return "free space on that disk"


def space_figures(
    needed: int | None, free: int | None, at_least: bool = False, quota: bool = False
) -> str:
    """``N bytes needed, M free``, the figures of a full disk's message (what is known).
    ``quota``: the user's quota is full, which the free space does not show."""
    room = "free space unknown" if free is None else f"{free:,} free"
    if quota:
        room = f"{room} on the disk, but the quota is exceeded"
    if needed is None:
        return room
    if at_least and not quota and free is not None and needed <= free:
        # the disk filled up during the write (what was written is free again): more than
        # all the free space is needed, which says more than the bytes written before
        return f"more than the {free:,} bytes free are needed"
    return f"{'at least ' if at_least else ''}{needed:,} bytes needed, {room}"


def full_figures(exc: OSError, directory: Path) -> str:
    """The figures of a full disk's error: those it carries, else the free space there."""
    if isinstance(exc, DiskFull):
        return space_figures(exc.needed, exc.free, exc.at_least, exc.errno == errno.EDQUOT)
    return space_figures(None, free_bytes(directory), quota=exc.errno == errno.EDQUOT)


def no_space(
    path: Path,
    needed: int,
    free: int | None = None,
    at_least: bool = False,
    code: int = errno.ENOSPC,
) -> DiskFull:
    """The one-line error of a full disk (``code``: ``errno.ENOSPC``, or ``EDQUOT``)."""
    free = free_bytes(path.parent) if free is None else free
    figures = space_figures(needed, free, at_least, code == errno.EDQUOT)
    error = DiskFull(code, f"{full_headline(code)} while writing {path}: {figures}")
    error.path, error.needed, error.at_least, error.free = path, needed, at_least, free
    return error


def check_space(path: Path, needed: int) -> None:
    """Raise :func:`no_space` if the file system of ``path`` has less than ``needed`` bytes."""
    free = free_bytes(path.parent if not path.is_dir() else path)
    if free is not None and free < needed:
        raise no_space(path, needed, free)


def is_disk_full(exc: BaseException, directory: Path) -> bool:
    """Whether ``exc``, raised while writing into ``directory``, means the disk is full."""
    if isinstance(exc, OSError):
        return exc.errno in FULL
    free = free_bytes(directory)
    return isinstance(exc, RuntimeError) and free is not None and free < _NEARLY_FULL


def atomic_write(path: str | Path, write: Callable[[Path], None], size: int | None = None) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, flush it, then rename it.

    ``size``: the bytes it will take, when known: checked against the free space first.
    The file gets the mode any new file of this process gets (0666 less the umask), not the
    temporary file's 0600, so others can read weights in a shared run directory.
    """
    path = Path(path)
    if size is not None:
        check_space(path, size)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        # after the write: some writers (safetensors) replace the file rather than reuse it
        os.chmod(tmp, 0o666 & ~current_umask())
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        full = is_disk_full(exc, path.parent)
        written = tmp.stat().st_size if full and tmp.exists() else 0
        if full:
            _release_frames(exc)
        tmp.unlink(missing_ok=True)
        if full:  # during the write: the free space was checked (size), or not known
            needed, at_least = max(size or 0, written), True
            code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.ENOSPC
            raise no_space(path, needed, at_least=at_least, code=code) from exc
        raise
    fsync_dir(path.parent)


def _release_frames(exc: BaseException) -> None:
    """Clear the frames of ``exc`` and of the errors it arose from: a writer's open file they
    hold (torch.save's zip writer, in an error of its ``__exit__``) keeps the temporary file's
    space taken after it is deleted, and the free space said would be wrong."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def atomic_write_text(path: str | Path, text: str) -> None:
    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    atomic_write(path, write, size=len(text.encode("utf-8")))
