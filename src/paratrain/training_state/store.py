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

import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from paratrain.atomic import atomic_write, fsync_dir

CHECKPOINTS = "checkpoints"
STATE = "state.json"
WEIGHTS = "model.safetensors"
#: test hook: seconds to sleep after a checkpoint is written under its temporary name and
#: before it is renamed into place, so a test can kill the process at that moment
STALL_VARIABLE = "PARATRAIN_TEST_STALL_SAVE"

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
        if step is not None and (child / STATE).is_file():
            found.append((step, child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def write_checkpoint(run_dir: Path, step: int, files: Mapping[str, FileWriter], keep: int) -> Path:
    """Write ``files`` (name -> writer of that file) as the checkpoint of ``step``, then keep
    only the newest ``keep`` checkpoints. Files are written in the mapping's order."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    remove_leftovers(root)
    final = root / checkpoint_name(step)
    tmp = root / f".{final.name}.tmp"
    tmp.mkdir()
    for name, write in files.items():
        atomic_write(tmp / name, write)
    fsync_dir(tmp)
    _stall_for_tests()
    if final.exists():  # the same step saved again (a run resumed from an earlier point)
        old = root / f".{final.name}.old"
        os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(root)
        shutil.rmtree(old)
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
            if _LEFTOVER.fullmatch(child.name) and child.is_dir():
                shutil.rmtree(child)


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


def _stall_for_tests() -> None:
    seconds = os.environ.get(STALL_VARIABLE)
    if seconds:
        time.sleep(float(seconds))
