"""The output directory of a `paratrain train` run and its contract.

metrics.jsonl      one JSON object per line: epoch, step, split, loss (+ accuracy)
timings.jsonl      one JSON object per epoch: its seconds, eval_seconds, checkpoint_seconds
model.safetensors  final weights, plain parameter names
config.json        resolved configuration, devices, versions, status and summary
checkpoints/       resumable checkpoints, step-NNNNNN/ each (see paratrain.checkpoints.state)
tensorboard/       TensorBoard event files (--tensorboard)
profile/           profiler traces (--profile STEPS)
hf/                config.json and model.safetensors of a Hugging Face recipe (from_pretrained)

Every name paratrain writes there is listed in :mod:`paratrain.training.run_files`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from paratrain.checkpoints.state.store import CHECKPOINTS, full_disk_advice
from paratrain.training.run_files import CONFIG as CONFIG
from paratrain.training.run_files import HUGGING_FACE, remove_previous_run
from paratrain.training.run_files import METRICS as METRICS
from paratrain.training.run_files import OWN_FILES as OWN_FILES
from paratrain.training.run_files import TENSORBOARD as TENSORBOARD
from paratrain.training.run_files import TIMINGS as TIMINGS
from paratrain.training.run_files import WEIGHTS as WEIGHTS
from paratrain.utils.atomic import (
    FULL,
    atomic_write,
    atomic_write_text,
    full_figures,
    full_headline,
)
from paratrain.utils.errors import UserError
from paratrain.version import __version__


def default_out(recipe: str) -> Path:
    name = recipe.replace("/", "-").replace(":", "-")  # hf:path/to/config.json
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_hugging_face_folder(directory: Path, config: dict[str, Any]) -> Path:
    """``directory/hf``: the model's config.json and its final weights (a hard link to the
    run's, a copy where links are not possible), as ``save_pretrained`` lays them out."""
    folder = directory / HUGGING_FACE
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    weights = folder / WEIGHTS
    weights.unlink(missing_ok=True)
    try:
        os.link(directory / WEIGHTS, weights)
    except OSError:
        shutil.copyfile(directory / WEIGHTS, weights)
    return folder


def read_status(directory: Path) -> str | None:
    """``finished``, ``running`` (started, not finished) or None (no run there)."""
    config = directory / CONFIG
    if config.is_file():
        try:
            return str(json.loads(config.read_text(encoding="utf-8")).get("status", "running"))
        except (OSError, ValueError):
            return "running"
    if any((directory / name).exists() for name in (WEIGHTS, METRICS, CHECKPOINTS)):
        return "running"
    return None


def read_config(directory: Path) -> dict[str, Any] | None:
    """The training configuration ``config.json`` records, or None (absent, unreadable)."""
    try:
        payload = json.loads((directory / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    config = payload.get("config") if isinstance(payload, dict) else None
    return config if isinstance(config, dict) else None


def prepare(out: str | Path | None, recipe: str, overwrite: bool) -> Path:
    """Check and create the run directory. Refuses, touching nothing, to reuse one that
    already holds a run unless ``overwrite``; then everything paratrain wrote there goes
    (:func:`run_files.remove_previous_run`), and nothing else."""
    directory = Path(out) if out is not None else default_out(recipe)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--out {directory} is a file, not a directory; choose another --out")
    status = read_status(directory) if directory.is_dir() else None
    if status is not None and not overwrite:
        if status == "finished":
            what, resume = "a finished run", f" (--resume {directory} --epochs N trains it further)"
        else:
            what, resume = "an unfinished run", f"; continue it with --resume {directory}"
        raise UserError(
            f"--out {directory} already holds {what}{resume}; pass --overwrite to replace it "
            "or choose another --out"
        )
    if overwrite and directory.is_dir():  # also what is left where no run is recognised
        remove_previous_run(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {directory}: {exc.strerror}") from None
    return directory


@contextlib.contextmanager
def full_disk_said(directory: Path, path: Path | None = None) -> Iterator[None]:
    """A full disk while writing ``path`` of the run (its final weights by default) becomes
    one line (``UserError``): the file, how much it needs and is free, and what to do. The
    checkpoints are untouched and ``config.json`` still says ``running``: a ``--resume``
    continues the run (and writes the final weights)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        what = f"the final weights {directory / WEIGHTS}" if path is None else str(path)
        then = " to write them" if path is None else ""
        advice = full_disk_advice(directory, then, "the run has no checkpoint", exc.errno)
        raise UserError(
            f"{full_headline(exc.errno)} while writing {what}: {full_figures(exc, directory)}; "
            f"{advice}"
        ) from None


def versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "paratrain": __version__,
        "cuda": str(torch.version.cuda),
    }


def write_config(directory: Path, payload: dict[str, Any]) -> None:
    atomic_write_text(directory / CONFIG, json.dumps(payload, indent=2, sort_keys=True) + "\n")


class MetricsWriter:
    """Appends one JSON line per record and flushes it, so a crash loses at most one line.

    ``keep_lines`` (a resumed run): first cut the file back to its first ``keep_lines``
    lines, those written before the checkpoint the run continues from.
    """

    def __init__(self, path: Path, keep_lines: int | None = None) -> None:
        if keep_lines is not None:
            text = path.read_text(encoding="utf-8") if path.exists() else ""
            kept = text.splitlines(keepends=True)[:keep_lines]
            kept = [line for line in kept if line.endswith("\n")]  # not a half-written line
            if len(kept) < keep_lines:  # never silently: the run's record has a gap
                print(
                    f"paratrain: note: {path} has {len(kept)} line(s), the checkpoint recorded "
                    f"{keep_lines}: {keep_lines - len(kept)} line(s) were lost before this resume",
                    file=sys.stderr,
                )
            if path.exists():
                atomic_write(path, lambda tmp: _write_lines(tmp, kept))
        self.lines = _count_lines(path)
        self.path = path
        self._handle: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        with full_disk_said(self.path.parent, self.path):
            self._handle.write(json.dumps(record, sort_keys=True) + "\n")
            self._handle.flush()
        self.lines += 1

    def close(self) -> None:
        self._handle.close()


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as handle:
        return sum(1 for _ in handle)


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(lines), encoding="utf-8")
