"""The decoded CIFAR-10 arrays, cached: the python pickles are decoded once, not every run.

Decoding the six batches takes seconds; reading them back from one uncompressed ``.npz``
takes a fraction of that. The cache lives in ``$PARATRAIN_CACHE_DIR``, else
``$XDG_CACHE_HOME/paratrain``, else ``~/.cache/paratrain`` (the data directory may be
read-only or shared), one file per batch folder, named by a hash of the folder's resolved
path and each batch file's name, size and modification time: replacing or editing a batch
makes a new entry. It is written atomically (a crash leaves no half file under its name)
and read without pickle (``allow_pickle=False``). It holds the raw uint8 images and int64
labels, before any normalisation. Where the cache cannot be written or read, the batches
are decoded as before: the cache only saves time.
"""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from paratrain.utils import environment
from paratrain.utils.atomic import atomic_write

CACHE_VARIABLE = "PARATRAIN_CACHE_DIR"
#: the arrays a cache entry holds, and their dtypes
FIELDS = {
    "train_data": np.uint8,
    "train_labels": np.int64,
    "test_data": np.uint8,
    "test_labels": np.int64,
}

Arrays = dict[str, np.ndarray]
_IMAGE_BYTES = 3 * 32 * 32


def cache_dir() -> Path:
    env = environment.current()
    explicit = env.get(CACHE_VARIABLE)
    if explicit:
        return Path(explicit).expanduser()
    return env.cache_home() / "paratrain"


def cache_path(batch_dir: Path, names: Sequence[str]) -> Path:
    """The cache file of the batches ``names`` in ``batch_dir`` as they are now."""
    digest = hashlib.sha256(str(batch_dir.resolve()).encode())
    for name in names:
        stat = (batch_dir / name).stat()
        digest.update(f"\0{name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return cache_dir() / f"cifar10-{digest.hexdigest()[:20]}.npz"


def cached_arrays(batch_dir: Path, names: Sequence[str], decode: Callable[[], Arrays]) -> Arrays:
    """The arrays ``decode()`` returns for ``batch_dir``, from the cache when it has them."""
    path = cache_path(batch_dir, names)
    arrays = _read(path)
    if arrays is not None:
        return arrays
    arrays = decode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: _write(tmp, arrays))
    except OSError:
        pass  # a read-only or full cache: training goes on from the decoded arrays
    return arrays


def _write(tmp: Path, arrays: Arrays) -> None:
    # Typed loosely: numpy's stubs read **arrays as its allow_pickle keyword (numpy >= 2.1).
    savez: Any = np.savez
    with open(tmp, "wb") as handle:  # a file object: np.savez would append ".npz" to a name
        savez(handle, **arrays)


def _read(path: Path) -> Arrays | None:
    """The entry's arrays, or None when it is missing, unreadable or not what it should be."""
    try:
        with np.load(path, allow_pickle=False) as entry:
            arrays = {name: entry[name] for name in FIELDS}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError):
        return None
    if any(arrays[name].dtype != dtype for name, dtype in FIELDS.items()):
        return None
    for split in ("train", "test"):
        data, labels = arrays[f"{split}_data"], arrays[f"{split}_labels"]
        if data.ndim != 2 or data.shape[1] != _IMAGE_BYTES or labels.shape != (len(data),):
            return None
    return arrays
