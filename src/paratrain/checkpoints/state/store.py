"""Checkpoint directories of a run: written crash-safely, listed, pruned.

    RUN/checkpoints/step-000123/   model.safetensors, optimizer.pt, ..., state.json

A checkpoint is assembled under a hidden temporary name (``.step-000123.tmp``), every file
flushed to disk, then renamed into place in one step and the parent directory flushed. A
directory named ``step-N`` is therefore complete; a crash leaves at most a hidden leftover,
which listing ignores and the next save removes. Old checkpoints are removed only after the
new one is in place, and renamed to a hidden name first so that a crash during removal never
leaves a half-deleted ``step-N``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from paratrain.checkpoints.state import manifest
from paratrain.utils import injection
from paratrain.utils.atomic import (
    FULL,
    DiskFull,
    atomic_write,
    check_space,
    free_bytes,
    fsync_dir,
    full_headline,
    make_room,
    space_figures,
)
from paratrain.utils.errors import UserError

CHECKPOINTS = "checkpoints"
STATE = "state.json"
WEIGHTS = "model.safetensors"

_COMPLETE = re.compile(r"step-(\d+)")
_LEFTOVER = re.compile(r"\.step-\d+\.(tmp|old)")

FileWriter = Callable[[Path], None]


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint directory's name, None for any other name."""
    match = _COMPLETE.fullmatch(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for child in root.iterdir():
        step = checkpoint_step(child)
        complete = (child / STATE).is_file() or (child / manifest.MANIFEST).is_file()
        if step is not None and complete:
            found.append((step, child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def write_checkpoint(
    run_dir: Path, step: int, files: Mapping[str, FileWriter], keep: int, size: int | None = None
) -> Path:
    """Write ``files`` (name -> writer of that file) as the checkpoint of ``step``, then keep
    only the newest ``keep`` checkpoints. Files are written in the mapping's order, then the
    manifest (:mod:`.manifest`). ``size``: about how many bytes they take, checked against
    the free space first. A full disk or another OS error is a ``UserError`` in one line,
    and leaves no part of this checkpoint behind."""
    root = run_dir / CHECKPOINTS
    final = root / checkpoint_name(step)
    tmp = root / f".{final.name}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root)
        if size is not None:
            check_space(final, size)
        tmp.mkdir()
        for name, write in files.items():
            atomic_write(tmp / name, write)
        built = manifest.build(tmp, step, files)
        atomic_write(tmp / manifest.MANIFEST, lambda path: _write_json(path, built))
        fsync_dir(tmp)
    except OSError as exc:
        written = _bytes_under(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(_os_error(exc, final, size, written)) from None
    injection.checkpoint_written(tmp)  # where a test may hold the save, to kill it there
    if final.exists() or final.is_symlink():  # the same step saved again (a resumed run)
        old = root / f".{final.name}.old"
        os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(root)
        _delete(old)
    else:
        os.rename(tmp, final)
        fsync_dir(root)
    prune(run_dir, keep)
    return final


def prune(run_dir: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints."""
    root = run_dir / CHECKPOINTS
    checkpoints = list_checkpoints(run_dir)
    for path in checkpoints[: max(0, len(checkpoints) - keep)]:
        _remove(path, root / f".{path.name}.old")
    fsync_dir(root)


def remove_leftovers(root: Path) -> None:
    """Delete the hidden directories an interrupted save or prune left behind."""
    if root.is_dir():
        for child in root.iterdir():
            if _LEFTOVER.fullmatch(child.name):
                _delete(child)


def _delete(path: Path) -> None:
    """Remove a directory tree, or a file (something put where a checkpoint was)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _os_error(exc: OSError, checkpoint: Path, size: int | None = None, written: int = 0) -> str:
    """One line: the checkpoint (its final name, not a temporary file's), and for a full
    disk how much it needs and is free, that the newest checkpoint is intact, what to do.
    ``size``: the checkpoint's estimated bytes; ``written``: its bytes written when it failed."""
    if exc.errno not in FULL:
        return f"cannot write {checkpoint}: {exc.strerror or exc}"
    root = checkpoint.parent
    if isinstance(exc, DiskFull) and not exc.at_least:  # refused before writing
        needed, at_least, free = exc.needed, False, exc.free
    else:  # failed during the write: the estimate (a lower bound) or what was written
        partial = written + (exc.needed if isinstance(exc, DiskFull) else 0)
        needed, at_least = max(partial, size or 0), True
        free = free_bytes(root if root.is_dir() else root.parent)  # with this one's gone
    figures = space_figures(needed or None, free, at_least, exc.errno == errno.EDQUOT)
    advice = full_disk_advice(root.parent, code=exc.errno)
    headline = full_headline(exc.errno)
    return f"{headline} while writing checkpoint {checkpoint}: {figures}; {advice}"


def full_disk_advice(
    run_dir: Path,
    after_resume: str = "",
    without: str = "no checkpoint of this run is complete yet",
    code: int | None = None,
) -> str:
    """What a run whose disk (``code``: the error's errno, ``EDQUOT`` for a full quota)
    filled up can do: resume from its newest checkpoint (intact), or train again where it
    has none (``without`` says so), or move to another disk."""
    newest = latest_checkpoint(run_dir)
    room = make_room(code)
    kept = (
        f"the newest checkpoint, {newest.name}, is intact: {room} and "
        f"--resume {run_dir}{after_resume}"
        if newest is not None
        else f"{without}: {room} and train again"
    )
    return f"{kept}, or train with --out on another disk"


def _bytes_under(directory: Path) -> int:
    """The bytes of the files in ``directory`` (0 where it is gone)."""
    total = 0
    with contextlib.suppress(OSError):
        for child in directory.iterdir():
            with contextlib.suppress(OSError):
                total += child.stat().st_size
    return total


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def remove_checkpoints(run_dir: Path) -> None:
    """Delete every checkpoint of a run (complete or not), and the folder if then empty."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return
    remove_leftovers(root)
    for path in list(root.iterdir()):
        if checkpoint_step(path) is not None and path.is_dir():
            _remove(path, root / f".{path.name}.old")
    if not any(root.iterdir()):
        root.rmdir()


def _remove(path: Path, hidden: Path) -> None:
    os.rename(path, hidden)
    shutil.rmtree(hidden)
