"""Every name paratrain writes into a run directory, so that ``--overwrite`` removes all of
a previous run and nothing else: a file or folder matching none of these is the user's.

    metrics.jsonl, timings.jsonl, model.safetensors, config.json   the run's own files
    checkpoints/step-NNNNNN/   (paratrain.checkpoints.state.store)
    tensorboard/events.out.tfevents.*   (--tensorboard)
    profile/rankR.*.pt.trace.json   (--profile STEPS)
    hf/config.json, hf/model.safetensors   (--recipe hf:NAME: what from_pretrained loads)
    model-int8.pt, model-int4.pt   (paratrain export without --out)
    .NAME.XXXXXXXX.tmp   an interrupted atomic write of one of these (paratrain.utils.atomic)
"""

from __future__ import annotations

import re
from pathlib import Path

from paratrain.checkpoints.state.store import remove_checkpoints

METRICS = "metrics.jsonl"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TIMINGS = "timings.jsonl"
OWN_FILES = (METRICS, WEIGHTS, CONFIG, TIMINGS)
TENSORBOARD = "tensorboard"
PROFILE = "profile"
HUGGING_FACE = "hf"
#: the quantizations `paratrain export` writes beside the run's weights by default
EXPORT_SCHEMES = ("int8", "int4")

#: what paratrain writes inside its folders (TensorBoard's and torch.profiler's file names)
_FOLDER_FILES = {
    TENSORBOARD: re.compile(r"events\.out\.tfevents\..+"),
    PROFILE: re.compile(r"rank\d+\.\d+\.pt\.trace\.json(\.gz)?"),
    HUGGING_FACE: re.compile(r"config\.json|model\.safetensors"),
}


def export_name(scheme: str) -> str:
    """The file `paratrain export` writes into the run directory for ``scheme``."""
    return f"model-{scheme}.pt"


def _top_files() -> tuple[str, ...]:
    return OWN_FILES + tuple(export_name(scheme) for scheme in EXPORT_SCHEMES)


def _leftover_pattern() -> re.Pattern[str]:
    names = "|".join(re.escape(name) for name in _top_files())
    return re.compile(rf"\.({names})\.[A-Za-z0-9_]+\.tmp")


def remove_previous_run(directory: Path) -> None:
    """Delete what a previous run (and its exports) wrote into ``directory``; a folder of
    paratrain's is removed once it holds nothing else."""
    for name in _top_files():
        (directory / name).unlink(missing_ok=True)
    leftover = _leftover_pattern()
    for child in directory.iterdir():
        if leftover.fullmatch(child.name) and child.is_file():
            child.unlink()
    remove_checkpoints(directory)
    for folder, pattern in _FOLDER_FILES.items():
        path = directory / folder
        if not path.is_dir() or path.is_symlink():
            continue
        for child in path.iterdir():
            if pattern.fullmatch(child.name) and child.is_file():
                child.unlink()
        if not any(path.iterdir()):
            path.rmdir()
