"""The decoded CIFAR-10 cache: decoded once, keyed by the batch files, safe to lose."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from paratrain.data import cifar
from paratrain.data.cifar import load_cifar10, write_fake_cifar_batches
from paratrain.data.cifar_cache import CACHE_VARIABLE, cache_path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_VARIABLE, str(folder))
    return folder


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    decoded: list[Path] = []
    read = cifar._read_batch

    def counting(path: Path) -> tuple[object, object]:
        decoded.append(path)
        return read(path)

    monkeypatch.setattr(cifar, "_read_batch", counting)
    return decoded


def _same(a: torch.utils.data.TensorDataset, b: torch.utils.data.TensorDataset) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))


def test_batches_are_decoded_once(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_fake_cifar_batches(tmp_path / "data", n_per_batch=5, seed=3)
    decoded = _count_decodes(monkeypatch)
    first = load_cifar10(tmp_path / "data")
    assert len(decoded) == 6 and len(list(cache.glob("cifar10-*.npz"))) == 1
    again = load_cifar10(tmp_path / "data")
    assert len(decoded) == 6  # read from the cache
    assert _same(first[0], again[0]) and _same(first[1], again[1])
    assert len(first[0]) == 25 and len(first[1]) == 5


def test_a_changed_batch_file_is_decoded_again(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    write_fake_cifar_batches(data, n_per_batch=4, seed=1)
    before = cache_path(data, cifar.CIFAR_FILES)
    first_train, _ = load_cifar10(data)
    batch = pickle.loads((data / "data_batch_1").read_bytes())
    batch[b"labels"] = [(label + 1) % 10 for label in batch[b"labels"]] + [0]
    batch[b"data"] = batch[b"data"][[0, 1, 2, 3, 0]]
    (data / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=2))
    assert cache_path(data, cifar.CIFAR_FILES) != before
    decoded = _count_decodes(monkeypatch)
    train, _ = load_cifar10(data)
    assert len(decoded) == 6 and len(train) == 21
    assert torch.equal(train.tensors[1][:4], (first_train.tensors[1][:4] + 1) % 10)


def test_a_damaged_or_unwritable_cache_only_costs_time(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    write_fake_cifar_batches(data, n_per_batch=3)
    expected, _ = load_cifar10(data)
    entry = cache_path(data, cifar.CIFAR_FILES)
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    decoded = _count_decodes(monkeypatch)
    train, _ = load_cifar10(data)
    assert len(decoded) == 6 and _same(train, expected)
    assert cache_path(data, cifar.CIFAR_FILES).stat().st_size > 100  # written again
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_VARIABLE, str(blocked))
    train, _ = load_cifar10(data)
    assert _same(train, expected)
    assert not any(name.endswith(".tmp") for name in os.listdir(cache))
