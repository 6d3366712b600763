"""Tar shards with their lengths (:mod:`paratrain.data.shards`): written and read back
through webdataset, an epoch's order drawn from the seed and the epoch alone, and only the
shards holding the places asked for opened."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import IO

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from paratrain.data.shards import INDEX, ShardStream, _npy, is_shard_folder, write_shards
from paratrain.utils.errors import UserError

pytest.importorskip("webdataset")


class _Counted(ShardStream):
    opened: list[str]

    def open_shard(self, path: str) -> IO[bytes]:
        self.opened.append(Path(path).name)
        return super().open_shard(path)


def _write(folder: Path, n: int = 23, per_shard: int = 5) -> None:
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1) / 7
    write_shards(
        folder, {"train": TensorDataset(x, torch.arange(n)), "test": TensorDataset(x)}, per_shard
    )


def test_shards_hold_the_samples_bit_for_bit_in_order(tmp_path: Path) -> None:
    _write(tmp_path)
    assert is_shard_folder(tmp_path) and not is_shard_folder(tmp_path / "nowhere")
    stream = ShardStream.from_folder(tmp_path)
    assert len(stream) == 23 and [s.samples for s in stream.shards] == [5, 5, 5, 5, 3]
    samples = list(stream)
    assert [int(i) for _, i in samples] == list(range(23))
    assert all(torch.equal(x, torch.tensor([i / 7], dtype=torch.float32)) for x, i in samples)
    assert samples[0][1].dtype == torch.int64
    test = list(ShardStream.from_folder(tmp_path, "test"))  # one tensor per sample
    assert len(test) == 23 and isinstance(test[0], torch.Tensor)


def test_a_shuffled_epochs_order_depends_on_the_seed_and_the_epoch_alone(tmp_path: Path) -> None:
    _write(tmp_path)

    def order(epoch: int, seed: int = 3) -> list[int]:
        stream = ShardStream.from_folder(tmp_path, shuffle=True, seed=seed)
        return [int(i) for _, i in stream.read([(0, 23)], epoch)]

    assert sorted(order(0)) == list(range(23))
    assert order(0) == order(0) and order(0) != order(1) and order(0) != order(0, seed=4)
    assert order(0) != list(range(23))


def test_only_the_shards_holding_the_places_asked_for_are_opened(tmp_path: Path) -> None:
    _write(tmp_path)
    stream = _Counted.from_folder(tmp_path, shuffle=True, seed=1)
    stream.opened = []
    whole = [int(i) for _, i in stream.read([(0, 23)], 2)]
    stream.opened = []
    # places 12..13 and 21..22: only the shards of the epoch's order that hold them
    part = [int(i) for _, i in stream.read([(12, 14), (21, 23)], 2)]
    assert part == whole[12:14] + whole[21:23]
    holding, first = [], 0
    for shard in stream.shard_order(2):
        last = first + stream.shards[shard].samples
        if any(first <= place < last for place in (12, 13, 21, 22)):
            holding.append(f"train-{shard:05d}.tar")
        first = last
    assert stream.opened == holding and len(holding) < len(stream.shards)


def test_a_folder_without_shards_or_webdataset_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        UserError, match=f"holds no {INDEX}: write shards with `paratrain data shard`"
    ):
        ShardStream.from_folder(tmp_path)
    _write(tmp_path)
    with pytest.raises(UserError, match="has no split 'valid'; it has train, test"):
        ShardStream.from_folder(tmp_path, "valid")
    monkeypatch.setitem(sys.modules, "webdataset", None)  # not installed
    with pytest.raises(
        UserError, match=r"^tar shards need the webdataset package: install paratrain\[stream\]$"
    ):
        list(ShardStream.from_folder(tmp_path))


def test_shards_of_no_samples_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"^samples per shard must be at least 1, got 0$"):
        write_shards(tmp_path, {"train": TensorDataset(torch.zeros(3))}, 0)
    assert not is_shard_folder(tmp_path)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        np.array(7, dtype=np.int64),
        np.array([True, False]),
        np.zeros((0, 3), dtype=np.float16),
    ],
    ids=["float32", "fortran", "0-d", "bool", "empty"],
)
def test_a_npy_member_decodes_as_numpy_loads_it_twice_in_a_row(array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array)
    for _ in range(2):  # the second time from the parsed header
        decoded = _npy("0.npy", buffer.getvalue())
        assert decoded.dtype == array.dtype and decoded.shape == array.shape
        assert decoded.tolist() == array.tolist()
        assert decoded.flags.writeable
