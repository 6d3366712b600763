"""Any supported source -> one flat ``{name: tensor}`` dict plus what else it said.

Sources: a safetensors file; a ``torch.save`` file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``)
holding a state dict, or a dict holding one under ``state_dict``/``model`` (Lightning and
common scripts); a dict or module in memory; a paratrain run directory (``model.safetensors``,
``config.json``) or training checkpoint directory (``model.safetensors``, ``state.json``).
Keys are kept as saved; prefixes are resolved by the loader and the converter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoints.files.readers import read_safetensors, read_torch, sniff
from paratrain.checkpoints.weights import unwrap_model
from paratrain.utils.errors import UserError

WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "state.json"
RUN_CONFIG = "config.json"
CHECKPOINTS_DIR = "checkpoints"
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
#: keys under which scripts and frameworks nest the weights, most specific first
CONTAINER_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "weights")

Source = str | Path | Mapping[str, Any] | nn.Module


@dataclass
class Checkpoint:
    """The weights of one source, with the names they were saved under."""

    source: str
    format: str  # safetensors | torch | dict | module
    tensors: dict[str, torch.Tensor]
    #: safetensors header metadata
    metadata: dict[str, str] = field(default_factory=dict)
    #: epoch, step, world_size, strategy... from state.json, config.json or the saved dict
    training_state: dict[str, Any] = field(default_factory=dict)
    #: top-level entries that are not weights (optimizer state, hyper-parameters...)
    other_entries: list[str] = field(default_factory=list)
    #: the file the tensors were read from (None: from memory)
    file: Path | None = None
    #: where inside the file's top-level dict, e.g. ``['state_dict']``
    location: str = ""

    def label(self) -> str:
        """``runs/x/model.safetensors``, ``last.ckpt['state_dict']``, ``<dict>``..."""
        return f"{self.file or self.source}{self.location}"


def read_checkpoint(source: Source) -> Checkpoint:
    """Read ``source`` safely (no pickled code runs) into a :class:`Checkpoint`."""
    if isinstance(source, nn.Module):
        state = unwrap_model(source).state_dict()
        return Checkpoint(type(source).__name__, "module", dict(state))
    if isinstance(source, Mapping):
        return _from_object(source, "<dict>", "dict")
    if not isinstance(source, (str, Path)):
        raise UserError(
            f"cannot load weights from a {type(source).__name__}: pass a path, "
            "a state dict or a module"
        )
    path = Path(source)
    if path.is_dir():
        return _read_directory(path)
    if not path.exists():
        raise UserError(f"no such file or directory: {path}")
    return read_file(path)


def read_file(path: Path) -> Checkpoint:
    if path.stat().st_size == 0:
        raise UserError(f"{path} is empty (0 bytes): an interrupted save? it holds no weights")
    kind = sniff(path)
    if kind == "safetensors":
        tensors, metadata = read_safetensors(path)
        return Checkpoint(str(path), "safetensors", tensors, metadata=metadata, file=path)
    if kind == "torch":
        checkpoint = _from_object(read_torch(path), str(path), "torch")
        checkpoint.file = path
        return checkpoint
    raise UserError(
        f"{path} is neither a safetensors nor a torch.save file (unrecognized first bytes); "
        "it may be truncated or corrupted"
    )


def _read_directory(directory: Path) -> Checkpoint:
    weights = directory / WEIGHTS_FILE
    if not weights.is_file() and (directory / STATE_FILE).is_file():
        # A training checkpoint: its other .pt files hold optimizer and generator states,
        # never weights.
        raise UserError(
            f"{weights} is missing: this checkpoint has no weights; inspect another "
            "checkpoint of the run, or the run's final model.safetensors"
        )
    if not weights.is_file():
        weights = _only_weights_file(directory)
    checkpoint = read_file(weights)
    checkpoint.source = str(directory)
    state = directory / STATE_FILE
    if state.is_file():
        checkpoint.training_state = _read_json(state)
    elif (directory / RUN_CONFIG).is_file():
        checkpoint.training_state = _run_state(_read_json(directory / RUN_CONFIG))
    return checkpoint


def _only_weights_file(directory: Path) -> Path:
    candidates = sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        names = ", ".join(p.name for p in candidates[:5])
        raise UserError(f"{directory} holds several weights files ({names}); pass one of them")
    latest = latest_checkpoint(directory)
    if latest is not None:
        raise UserError(
            f"{directory} has no {WEIGHTS_FILE} (an unfinished run?); "
            f"its latest checkpoint is {latest}: pass that"
        )
    raise UserError(f"{directory} holds no {WEIGHTS_FILE} or other weights file")


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The ``checkpoints/step-N`` directory of a run with the highest step, if any."""
    steps: list[tuple[int, Path]] = []
    root = run_dir / CHECKPOINTS_DIR
    if root.is_dir():
        for child in root.iterdir():
            match = re.fullmatch(r"step-(\d+)", child.name)
            if match and (child / WEIGHTS_FILE).is_file():
                steps.append((int(match.group(1)), child))
    return max(steps)[1] if steps else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is unreadable or not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} should hold a JSON object, found {type(data).__name__}")
    return data


def _run_state(config: dict[str, Any]) -> dict[str, Any]:
    """What a run directory's config.json says about how far training got."""
    runtime = config.get("runtime") or {}
    summary = config.get("summary") or {}
    state = {
        "status": config.get("status"),
        "recipe": (config.get("config") or {}).get("recipe"),
        "epochs": summary.get("epochs"),
        "step": summary.get("steps"),
        "world_size": runtime.get("world_size"),
        "strategy": runtime.get("strategy"),
    }
    return {key: value for key, value in state.items() if value is not None}


def _from_object(obj: Any, source: str, fmt: str) -> Checkpoint:
    """Find the state dict inside what ``torch.load`` returned (or a dict given in memory)."""
    if not isinstance(obj, Mapping):
        raise UserError(
            f"{source} holds a {type(obj).__name__}, not a state dict; "
            "save model.state_dict() instead"
        )
    location = ""
    top: Mapping[str, Any] = obj
    for _ in range(3):  # {"checkpoint": {"model": {...}}} at most a few levels deep
        key = _container_key(obj)
        if key is None:
            break
        location = f"{location}[{key!r}]"
        obj = obj[key]
    tensors = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        keys = ", ".join(map(str, list(top)[:8])) or "nothing"
        raise UserError(
            f"{source} holds no tensors: its top-level keys are {keys}; expected a state dict "
            f"or a dict with one under {' or '.join(repr(k) for k in CONTAINER_KEYS[:3])}"
        )
    other = [str(k) for k, v in top.items() if not isinstance(v, torch.Tensor)]
    scalars = {str(k): v for k, v in top.items() if isinstance(v, (int, float, str, bool))}
    return Checkpoint(
        source,
        fmt,
        tensors,
        training_state=scalars,
        other_entries=[
            k for k in other if k not in scalars and not location.startswith(f"[{k!r}]")
        ],
        location=location,
    )


def _container_key(obj: Mapping[str, Any]) -> str | None:
    for key in CONTAINER_KEYS:
        value = obj.get(key)
        if isinstance(value, Mapping) and _holds_tensors(value):
            return key
    return None


def _holds_tensors(obj: Mapping[str, Any]) -> bool:
    return any(
        isinstance(v, torch.Tensor) or (isinstance(v, Mapping) and _holds_tensors(v))
        for v in obj.values()
    )
