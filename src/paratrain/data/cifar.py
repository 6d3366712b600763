"""CIFAR-10 from the standard python batches, plus synthetic and fake stand-ins.

The python batches are pickles, and unpickling runs code named in the file. The loader
therefore only resolves the few numpy constructors a batch needs and refuses everything
else, so a tampered file cannot execute anything.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from paratrain.data.cifar_cache import cached_arrays
from paratrain.data.images import NormalizedImages
from paratrain.utils.errors import UserError

CIFAR_FILES = (
    "data_batch_1",
    "data_batch_2",
    "data_batch_3",
    "data_batch_4",
    "data_batch_5",
    "test_batch",
)
CIFAR_SUBDIR = "cifar-10-batches-py"
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
_IMAGE_BYTES = 3 * 32 * 32

# (module, name) pairs a CIFAR batch may reference, mapped to where the object lives in
# the installed numpy. numpy 2 renamed numpy.core to numpy._core; files written by either
# name must load, and resolving here avoids importing the deprecated alias.
_NUMPY_GLOBALS: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {}
for _core in ("numpy.core", "numpy._core"):
    _NUMPY_GLOBALS[(f"{_core}.multiarray", "_reconstruct")] = (
        ("numpy._core.multiarray", "numpy.core.multiarray"),
        "_reconstruct",
    )
    _NUMPY_GLOBALS[(f"{_core}.multiarray", "ndarray")] = (("numpy",), "ndarray")
    _NUMPY_GLOBALS[(f"{_core}.multiarray", "dtype")] = (("numpy",), "dtype")
    # Arrays pickled with protocol 5 are rebuilt with _frombuffer (a plain np.frombuffer).
    _NUMPY_GLOBALS[(f"{_core}.numeric", "_frombuffer")] = (
        ("numpy._core.numeric", "numpy.core.numeric"),
        "_frombuffer",
    )
_NUMPY_GLOBALS[("numpy", "ndarray")] = (("numpy",), "ndarray")
_NUMPY_GLOBALS[("numpy", "dtype")] = (("numpy",), "dtype")

# Pickles written by Python 3 with protocol <= 2 store bytes as _codecs.encode(str, "latin1").
_OTHER_GLOBALS: dict[tuple[str, str], Callable[..., Any]] = {}
_codecs = importlib.import_module("_codecs")
_OTHER_GLOBALS[("_codecs", "encode")] = _codecs.encode
_OTHER_GLOBALS[("builtins", "bytes")] = bytes
_OTHER_GLOBALS[("builtins", "bytearray")] = bytearray


def _resolve_numpy(modules: tuple[str, ...], name: str) -> Any:
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise AttributeError(f"numpy has no {name} in {', '.join(modules)}")


class _SafeUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals a CIFAR-10 batch needs."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file, encoding="bytes")
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _OTHER_GLOBALS:
            return _OTHER_GLOBALS[key]
        if key in _NUMPY_GLOBALS:
            return _resolve_numpy(*_NUMPY_GLOBALS[key])
        raise UserError(
            f"{self._path} is not a CIFAR-10 batch: it references {module}.{name}, "
            "which is refused (only numpy arrays are allowed)"
        )


def _get(batch: dict[Any, Any], key: str) -> Any:
    if key.encode() in batch:
        return batch[key.encode()]
    return batch.get(key)


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Return (uint8 data (N, 3072), int64 labels (N,)) from one python batch file."""
    try:
        with path.open("rb") as fh:
            batch = _SafeUnpickler(fh, path).load()
    except UserError:
        raise
    except OSError as exc:
        raise UserError(f"cannot read CIFAR-10 batch {path}: {exc.strerror or exc}") from exc
    except Exception as exc:
        # Truncated or corrupted files fail in many ways (EOFError, UnpicklingError,
        # ValueError from numpy...); all mean the same thing to the user.
        raise UserError(
            f"{path} is corrupted or truncated ({type(exc).__name__}); "
            "re-extract cifar-10-python.tar.gz"
        ) from exc
    if not isinstance(batch, dict):
        raise UserError(f"{path} is not a CIFAR-10 batch: expected a dict, got {type(batch)}")
    data = _get(batch, "data")
    labels = _get(batch, "labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise UserError(f"{path} is not a CIFAR-10 batch: 'data' is not a uint8 N x 3072 array")
    if data.shape[1] != _IMAGE_BYTES:
        raise UserError(f"{path} is not a CIFAR-10 batch: rows have {data.shape[1]} bytes")
    try:
        label_arr = np.asarray(labels, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{path} is not a CIFAR-10 batch: 'labels' is not a list of ints") from exc
    if label_arr.shape[0] != data.shape[0]:
        raise UserError(
            f"{path} is not a CIFAR-10 batch: {data.shape[0]} images but "
            f"{label_arr.shape[0]} labels"
        )
    if label_arr.size and (label_arr.min() < 0 or label_arr.max() > 9):
        raise UserError(f"{path} is not a CIFAR-10 batch: labels outside 0..9")
    return data, label_arr


def _find_batch_dir(data_dir: Path) -> Path:
    for candidate in (data_dir, data_dir / CIFAR_SUBDIR):
        if all((candidate / name).is_file() for name in CIFAR_FILES):
            return candidate
    raise UserError(
        f"--data-dir {data_dir} lacks the CIFAR-10 python batches: {', '.join(CIFAR_FILES)} "
        f"(looked there and in {CIFAR_SUBDIR}/; download cifar-10-python.tar.gz and "
        "extract it there)"
    )


def _to_dataset(data: np.ndarray, labels: np.ndarray) -> NormalizedImages:
    # Rows are 1024 red, 1024 green, then 1024 blue bytes, so NCHW is a plain reshape.
    x = torch.from_numpy(np.require(data.reshape(-1, 3, 32, 32), requirements=["C", "W"]))
    return NormalizedImages(x, torch.from_numpy(labels.astype(np.int64)), CIFAR_MEAN, CIFAR_STD)


def load_cifar10(data_dir: str | Path) -> tuple[NormalizedImages, NormalizedImages]:
    """Return (train, test): samples are normalised float32 images (3,32,32), int64 labels.

    The images stay uint8 in memory and are normalised per sample or per batch
    (:class:`~paratrain.data.images.NormalizedImages`), to the same floats either way.
    ``data_dir`` may hold the batch files or the extracted ``cifar-10-batches-py`` folder.
    """
    batch_dir = _find_batch_dir(Path(data_dir).expanduser())
    arrays = cached_arrays(batch_dir, CIFAR_FILES, lambda: _decode(batch_dir))
    return (
        _to_dataset(arrays["train_data"], arrays["train_labels"]),
        _to_dataset(arrays["test_data"], arrays["test_labels"]),
    )


def _decode(batch_dir: Path) -> dict[str, np.ndarray]:
    """The six python batches as uint8 images (N, 3072) and int64 labels, train and test."""
    train = [_read_batch(batch_dir / name) for name in CIFAR_FILES[:-1]]
    test_data, test_labels = _read_batch(batch_dir / CIFAR_FILES[-1])
    return {
        "train_data": np.concatenate([d for d, _ in train]),
        "train_labels": np.concatenate([lab for _, lab in train]),
        "test_data": test_data,
        "test_labels": test_labels,
    }


def synthetic_cifar10(n: int, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Random CIFAR-shaped data: ``n`` train and ``max(1, n // 5)`` test samples.

    Useful for timing layouts without the real data set; the numbers are meaningless
    for accuracy but identical for the same ``seed``.
    """
    if n < 1:
        raise UserError(f"synthetic CIFAR-10 needs at least 1 sample, got {n}")
    gen = torch.Generator().manual_seed(seed)
    n_test = max(1, n // 5)
    train_x = torch.randn(n, 3, 32, 32, generator=gen, dtype=torch.float32)
    train_y = torch.randint(0, 10, (n,), generator=gen, dtype=torch.int64)
    test_x = torch.randn(n_test, 3, 32, 32, generator=gen, dtype=torch.float32)
    test_y = torch.randint(0, 10, (n_test,), generator=gen, dtype=torch.int64)
    return TensorDataset(train_x, train_y), TensorDataset(test_x, test_y)


def write_fake_cifar_batches(
    directory: str | Path, n_per_batch: int = 20, seed: int = 0, protocol: int = 2
) -> None:
    """Write tiny files in the CIFAR-10 python format, so tests need no download.

    Protocol 2 matches the real files, which were written by Python 2's cPickle.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, name in enumerate(CIFAR_FILES):
        if name == "test_batch":
            batch_label = b"testing batch 1 of 1"
        else:
            batch_label = f"training batch {i + 1} of 5".encode()
        batch = {
            b"batch_label": batch_label,
            b"labels": [int(v) for v in rng.integers(0, 10, size=n_per_batch)],
            b"data": rng.integers(0, 256, size=(n_per_batch, _IMAGE_BYTES), dtype=np.uint8),
            b"filenames": [f"fake_{i}_{j}.png".encode() for j in range(n_per_batch)],
        }
        with (out / name).open("wb") as fh:
            pickle.dump(batch, fh, protocol=protocol)
