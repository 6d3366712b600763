"""A checkpoint's manifest: what was written, so that what is read can be verified.

``manifest.json`` is written last into a checkpoint (before the directory is renamed into
place). It records the step once and every other file's size and BLAKE2b checksum, of the
bytes as they lie on disk::

    {"format": 1, "step": 60, "files": {"model.safetensors": {"size": 605920,
     "blake2b": "9f0c..."}, "optimizer.pt": {...}, "state.json": {...}, ...}}

:func:`verify` checks a checkpoint against it: a missing, extra, resized or altered file,
or a step that differs from the directory's name or ``state.json``'s, is an error naming it.
Checkpoints written before manifests existed (``state.json`` format 1) have none; they are
read unverified, with a note.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
STATE = "state.json"
FORMAT = 1
_CHUNK = 1 << 20


class Damaged(Exception):
    """A checkpoint that does not match its manifest; the message names the file."""


def checksum(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build(directory: Path, step: int, names: Iterable[str]) -> dict[str, Any]:
    """The manifest of the files ``names`` of ``directory`` as they are now."""
    files = {
        name: {"size": (directory / name).stat().st_size, "blake2b": checksum(directory / name)}
        for name in sorted(names)
    }
    return {"format": FORMAT, "step": step, "files": files}


def read(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's manifest; None if it has none; :class:`Damaged` if unreadable."""
    path = checkpoint / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise Damaged(f"{path} is unreadable or not JSON ({exc})") from None
    if (
        not isinstance(manifest, dict)
        or not isinstance(manifest.get("files"), dict)
        or not isinstance(manifest.get("step"), int)
    ):
        raise Damaged(f"{path} is not a checkpoint manifest")
    return manifest


def verify(checkpoint: Path, name_step: int | None) -> dict[str, Any]:
    """Check every file of ``checkpoint`` against its manifest (which must exist), then the
    step of the directory's name (``name_step``) and of ``state.json``; returns the
    manifest."""
    manifest = read(checkpoint)
    if manifest is None:
        raise Damaged(f"{checkpoint / MANIFEST} is missing")
    expected: dict[str, Any] = manifest["files"]
    # Hidden files are not ours to judge (Ray Tune keeps its .metadata.json in a copy).
    present = {p.name for p in checkpoint.iterdir() if not p.name.startswith(".")} - {MANIFEST}
    extra = sorted(present - set(expected))
    if extra:
        raise Damaged(f"{checkpoint / extra[0]} is not in the manifest: an extra file")
    for name, record in sorted(expected.items()):
        path = checkpoint / name
        if not path.exists():
            raise Damaged(f"{path} is missing")
        if not path.is_file():
            raise Damaged(f"{path} is not a file")
        size = path.stat().st_size
        if size != record.get("size"):
            raise Damaged(f"{path} has {size} bytes; {record.get('size')} were written")
        if checksum(path) != record.get("blake2b"):
            raise Damaged(f"{path} was altered: its checksum differs from the one written")
    step = manifest["step"]
    if name_step is not None and name_step != step:
        raise Damaged(f"{checkpoint} holds step {step}, not the step of its name ({name_step})")
    state = checkpoint / STATE
    if STATE in expected:
        try:
            state_step = json.loads(state.read_text(encoding="utf-8")).get("step")
        except (OSError, ValueError, AttributeError):
            state_step = None
        if state_step != step:
            raise Damaged(f"{state} says step {state_step}; the manifest says {step}")
    return manifest
