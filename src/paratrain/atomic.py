"""Crash-safe file writes: a file is either complete under its name, or absent."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


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


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, flush it, then rename it.

    The file gets the mode any new file of this process gets (0666 less the umask), not the
    temporary file's 0600, so others can read weights in a shared run directory.
    """
    path = Path(path)
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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    atomic_write(path, write)
