"""Tests for the bundled digits set and the CIFAR-10 loaders (no download needed)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import paratrain.data as paratrain_data
from paratrain.data import (
    CIFAR_FILES,
    load_cifar10,
    load_digits_split,
    synthetic_cifar10,
    write_fake_cifar_batches,
)
from paratrain.utils.errors import UserError

# --- digits -------------------------------------------------------------------------


def test_digits_split_sizes_and_types() -> None:
    train, test = load_digits_split()
    assert len(train) == 1437 and len(test) == 360
    x, y = train.tensors
    assert x.shape == (1437, 1, 8, 8) and x.dtype == torch.float32
    assert y.shape == (1437,) and y.dtype == torch.int64
    assert test.tensors[0].shape == (360, 1, 8, 8)


def test_digits_values_and_classes() -> None:
    train, test = load_digits_split()
    for ds in (train, test):
        x, y = ds.tensors
        assert x.min().item() >= 0.0 and x.max().item() <= 1.0
        assert x.max().item() == 1.0
        assert set(y.tolist()) == set(range(10))


def test_digits_split_is_fixed() -> None:
    torch.manual_seed(123)
    a_train, a_test = load_digits_split()
    torch.manual_seed(456)
    b_train, b_test = load_digits_split()
    for a, b in zip(
        a_train.tensors + a_test.tensors, b_train.tensors + b_test.tensors, strict=True
    ):
        assert torch.equal(a, b)


def test_digits_split_is_a_partition() -> None:
    train, test = load_digits_split()
    x = torch.cat([train.tensors[0], test.tensors[0]]).flatten(1)
    assert x.shape[0] == 1797
    # Same multiset of labels as the full set, with every class roughly balanced.
    y = torch.cat([train.tensors[1], test.tensors[1]])
    assert torch.bincount(y, minlength=10).min().item() >= 170


# --- CIFAR-10 -----------------------------------------------------------------------


def test_load_cifar10_from_fake_batches(tmp_path: Path) -> None:
    write_fake_cifar_batches(tmp_path, n_per_batch=8, seed=1)
    train, test = load_cifar10(tmp_path)
    images, y = train.tensors  # kept as bytes, normalised when read
    assert images.shape == (40, 3, 32, 32) and images.dtype == torch.uint8
    assert y.shape == (40,) and y.dtype == torch.int64
    assert test.tensors[0].shape == (8, 3, 32, 32)
    assert int(y.min()) >= 0 and int(y.max()) <= 9
    x = train[0][0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32

    # Normalisation: pixel p of channel c becomes (p / 255 - mean[c]) / std[c].
    with (tmp_path / "data_batch_1").open("rb") as fh:
        raw = pickle.load(fh, encoding="bytes")
    first = raw[b"data"][0].reshape(3, 32, 32).astype(np.float32) / 255.0
    mean = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32).reshape(3, 1, 1)
    std = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32).reshape(3, 1, 1)
    np.testing.assert_allclose(x.numpy(), (first - mean) / std, rtol=1e-5, atol=1e-5)
    assert y[:8].tolist() == raw[b"labels"]


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_load_cifar10_any_pickle_protocol(tmp_path: Path, protocol: int) -> None:
    write_fake_cifar_batches(tmp_path, n_per_batch=3, protocol=protocol)
    train, test = load_cifar10(str(tmp_path))
    assert len(train) == 15 and len(test) == 3


def test_load_cifar10_numpy1_module_names(tmp_path: Path) -> None:
    # The real batches (and numpy < 2) name numpy.core.multiarray, not numpy._core.
    write_fake_cifar_batches(tmp_path, n_per_batch=3, protocol=2)
    for name in CIFAR_FILES:
        path = tmp_path / name
        blob = path.read_bytes()
        assert b"cnumpy._core.multiarray\n" in blob
        path.write_bytes(blob.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n"))
    train, test = load_cifar10(tmp_path)
    assert len(train) == 15 and len(test) == 3


def test_load_cifar10_from_subfolder(tmp_path: Path) -> None:
    write_fake_cifar_batches(tmp_path / "cifar-10-batches-py", n_per_batch=4)
    train, test = load_cifar10(tmp_path)
    assert len(train) == 20 and len(test) == 4


def test_load_cifar10_missing_files_message(tmp_path: Path) -> None:
    with pytest.raises(UserError) as info:
        load_cifar10(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg
    assert str(tmp_path) in msg
    for name in CIFAR_FILES:
        assert name in msg


def test_load_cifar10_one_file_missing(tmp_path: Path) -> None:
    write_fake_cifar_batches(tmp_path, n_per_batch=2)
    (tmp_path / "data_batch_4").unlink()
    with pytest.raises(UserError, match="data_batch_4"):
        load_cifar10(tmp_path)


class _Evil:
    """Unpickling this would run a shell command that creates a file."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.target}",))


class _EvilOpen:
    """Unpickling this would create a file through builtins.open."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.target), "w"))


@pytest.mark.parametrize("evil_cls", [_Evil, _EvilOpen])
@pytest.mark.parametrize("protocol", [2, 4])
def test_malicious_pickle_is_refused(tmp_path: Path, evil_cls: type, protocol: int) -> None:
    data_dir = tmp_path / "data"
    write_fake_cifar_batches(data_dir, n_per_batch=2)
    target = tmp_path / "pwned"
    payload = {b"data": evil_cls(target), b"labels": [0, 1]}
    (data_dir / "data_batch_2").write_bytes(pickle.dumps(payload, protocol=protocol))
    with pytest.raises(UserError, match="data_batch_2") as info:
        load_cifar10(data_dir)
    assert "refused" in str(info.value)
    assert not target.exists()


def test_malicious_pickle_outside_numpy_names(tmp_path: Path) -> None:
    # A global that merely looks like numpy is still refused.
    data_dir = tmp_path / "data"
    write_fake_cifar_batches(data_dir, n_per_batch=2)
    payload = b"\x80\x02cnumpy\nload\nq\x00."
    (data_dir / "test_batch").write_bytes(payload)
    with pytest.raises(UserError, match="test_batch"):
        load_cifar10(data_dir)


def test_truncated_batch_is_a_user_error(tmp_path: Path) -> None:
    write_fake_cifar_batches(tmp_path, n_per_batch=4)
    path = tmp_path / "data_batch_3"
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UserError, match="data_batch_3"):
        load_cifar10(tmp_path)


def test_garbage_batch_is_a_user_error(tmp_path: Path) -> None:
    write_fake_cifar_batches(tmp_path, n_per_batch=4)
    (tmp_path / "test_batch").write_bytes(b"not a pickle at all")
    with pytest.raises(UserError, match="test_batch"):
        load_cifar10(tmp_path)


def test_wrong_structure_is_a_user_error(tmp_path: Path) -> None:
    write_fake_cifar_batches(tmp_path, n_per_batch=4)
    bad = {b"data": np.zeros((4, 10), dtype=np.uint8), b"labels": [0, 1, 2, 3]}
    (tmp_path / "data_batch_5").write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(UserError, match="data_batch_5"):
        load_cifar10(tmp_path)


def test_user_error_is_value_error() -> None:
    assert issubclass(UserError, ValueError)


# --- synthetic ----------------------------------------------------------------------


def test_synthetic_shapes() -> None:
    train, test = synthetic_cifar10(12, seed=3)
    x, y = train.tensors
    assert x.shape == (12, 3, 32, 32) and x.dtype == torch.float32
    assert y.shape == (12,) and y.dtype == torch.int64
    assert int(y.min()) >= 0 and int(y.max()) <= 9
    assert len(test) == 2
    assert len(synthetic_cifar10(1)[1]) == 1


def test_synthetic_is_deterministic() -> None:
    a = synthetic_cifar10(10, seed=5)
    b = synthetic_cifar10(10, seed=5)
    c = synthetic_cifar10(10, seed=6)
    for ta, tb in zip(a[0].tensors + a[1].tensors, b[0].tensors + b[1].tensors, strict=True):
        assert torch.equal(ta, tb)
    assert not torch.equal(a[0].tensors[0], c[0].tensors[0])


def test_synthetic_ignores_global_seed() -> None:
    torch.manual_seed(1)
    a = synthetic_cifar10(4)
    torch.manual_seed(2)
    b = synthetic_cifar10(4)
    assert torch.equal(a[0].tensors[0], b[0].tensors[0])


@pytest.mark.parametrize("n", [0, -3])
def test_synthetic_rejects_empty(n: int) -> None:
    with pytest.raises(UserError):
        synthetic_cifar10(n)


@pytest.mark.slow
def test_no_torchvision_or_sklearn_imported() -> None:
    # A fresh interpreter, so imports made by other tests cannot hide or fake the result.
    code = (
        "import sys, paratrain.data, paratrain.models\n"
        "paratrain.data.load_digits_split()\n"
        "bad = [m for m in ('torchvision', 'sklearn') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    src = str(Path(paratrain_data.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
