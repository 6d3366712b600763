"""Rewrite any supported checkpoint as plain-named weights (safetensors or ``torch.save``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from paratrain.checkpoints.files.formats import Source, read_checkpoint
from paratrain.checkpoints.files.keys import prefix_counts, wrapper_chain
from paratrain.checkpoints.weights import plain_tensors, strip_prefixes
from paratrain.utils.atomic import atomic_write
from paratrain.utils.errors import UserError

TORCH_SUFFIXES = (".pt", ".pth", ".bin")


@dataclass
class ConvertResult:
    destination: Path
    format: str  # safetensors | torch
    tensors: int
    bytes: int
    #: wrapper prefix chains removed, and the --strip-prefix given
    removed: list[str] = field(default_factory=list)
    #: entries of the source that are not weights (optimizer state...), not written
    left_out: list[str] = field(default_factory=list)


def output_format(path: Path) -> str:
    if path.suffix == ".safetensors":
        return "safetensors"
    if path.suffix in TORCH_SUFFIXES:
        return "torch"
    raise UserError(
        f"cannot tell the format of {path} from its name: end it with .safetensors "
        f"(recommended) or {', '.join(TORCH_SUFFIXES)}"
    )


def convert_checkpoint(
    source: Source, destination: str | Path, overwrite: bool = False, strip_prefix: str = ""
) -> ConvertResult:
    """Write ``source``'s tensors to ``destination`` with wrapper prefixes removed, atomically.

    Refuses, touching nothing, to replace an existing ``destination`` unless ``overwrite``.
    ``strip_prefix`` also removes a prefix such as Lightning's ``model.``.
    """
    destination = Path(destination)
    fmt = output_format(destination)
    if destination.is_dir():
        raise UserError(f"{destination} is a directory; name a file ending with .safetensors")
    if destination.exists() and not overwrite:
        raise UserError(f"{destination} already exists; pass --overwrite to replace it")
    checkpoint = read_checkpoint(source)
    state = plain_tensors(checkpoint.tensors)
    if len(state) != len(checkpoint.tensors):
        raise UserError(
            f"{checkpoint.source} holds the same tensor under several wrapper prefixes "
            "(e.g. both 'module.x' and 'x'); cannot tell which to keep"
        )
    removed = sorted({c for c in map(wrapper_chain, checkpoint.tensors) if c})
    if strip_prefix:
        state = _strip(state, strip_prefix, checkpoint.source)
        removed.append(strip_prefix)
    destination.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        atomic_write(destination, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    else:
        atomic_write(destination, lambda tmp: torch.save(state, tmp))
    size = sum(t.numel() * t.element_size() for t in state.values())
    return ConvertResult(destination, fmt, len(state), size, removed, checkpoint.other_entries)


def _strip(state: dict[str, torch.Tensor], prefix: str, source: str) -> dict[str, torch.Tensor]:
    if not prefix.endswith("."):
        prefix += "."
    if not any(key.startswith(prefix) for key in state):
        found = ", ".join(p for p in prefix_counts(state) if p) or "none"
        raise UserError(f"no key of {source} starts with {prefix!r} (prefixes found: {found})")
    stripped = {
        (strip_prefixes(k[len(prefix) :]) if k.startswith(prefix) else k): v
        for k, v in state.items()
    }
    if len(stripped) != len(state):
        raise UserError(f"removing {prefix!r} from {source}'s keys makes two of them the same")
    return stripped
