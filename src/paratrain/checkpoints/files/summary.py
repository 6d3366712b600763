"""What a checkpoint holds, as a JSON-ready dict (``paratrain ckpt inspect``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from paratrain.checkpoints.files.formats import Checkpoint, latest_checkpoint
from paratrain.checkpoints.files.keys import WRAPPER_SEGMENTS, prefix_counts

#: the training-state entries shown first, in this order
STATE_KEYS = ("status", "epoch", "epochs", "step", "global_step", "world_size", "strategy")


def summarize(checkpoint: Checkpoint) -> dict[str, Any]:
    tensors = [
        {
            "name": name,
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "numel": tensor.numel(),
            "bytes": tensor.numel() * tensor.element_size(),
        }
        for name, tensor in checkpoint.tensors.items()
    ]
    prefixes = prefix_counts(checkpoint.tensors)
    return {
        "source": checkpoint.source,
        "file": None if checkpoint.file is None else str(checkpoint.file),
        "file_bytes": None if checkpoint.file is None else checkpoint.file.stat().st_size,
        "location": checkpoint.location,
        "format": checkpoint.format,
        "count": len(tensors),
        "parameters": sum(t["numel"] for t in tensors),
        "bytes": sum(t["bytes"] for t in tensors),
        "dtypes": dict(Counter(t["dtype"] for t in tensors).most_common()),
        "prefixes": prefixes,
        "training_state": _ordered_state(checkpoint.training_state),
        "metadata": checkpoint.metadata,
        "other_entries": checkpoint.other_entries,
        "latest_checkpoint": _latest(checkpoint.source),
        "hints": _hints(prefixes, len(tensors)),
        "tensors": tensors,
    }


def _latest(source: str) -> str | None:
    """A run directory's newest training checkpoint, which may be newer than its weights."""
    path = Path(source)
    latest = latest_checkpoint(path) if path.is_dir() else None
    return None if latest is None else str(latest)


def _ordered_state(state: dict[str, Any]) -> dict[str, Any]:
    first = {key: state[key] for key in STATE_KEYS if key in state}
    return {**first, **{k: v for k, v in state.items() if k not in first}}


def _hints(prefixes: dict[str, int], count: int) -> list[str]:
    hints = []
    wrappers = [p for p in prefixes if p.rstrip(".").split(".")[0] in WRAPPER_SEGMENTS]
    if wrappers:
        hints.append(
            f"saved from a wrapped model ({', '.join(wrappers)}): paratrain.load_weights "
            "loads it into any layout; `paratrain ckpt convert` writes plain names"
        )
    shared = [p for p in prefixes if p not in wrappers]
    if shared and count > 1:
        hints.append(
            f"every key starts with {shared[0]!r}: if that is a wrapper's attribute "
            f"(Lightning's self.model), `paratrain ckpt convert --strip-prefix {shared[0]}` "
            "removes it; load_weights removes it by itself when the model's keys lack it"
        )
    return hints
