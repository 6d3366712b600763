"""An IterableDataset split into global batches across workers and processes (the rule of
:mod:`paratrain.data.iterable_split`), and the end of its epoch seen one batch ahead only
where accumulated micro-batches need it. Workers as real processes:
tests/integration/test_iterable_split.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from paratrain.data.iterable_split import (
    CollateParts,
    GlobalBatches,
    SplitIterable,
    split_iterable_loader,
)
from paratrain.data.loaders import BatchInfo, batch_info, shard_loader
from paratrain.data.stream_loader import StreamLoader
from paratrain.utils.errors import UserError

CPU = torch.device("cpu")


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(self.n).unbind())


class _SplitsItself(_Stream):
    splits_itself = True


class _ShardsByWorker(_Stream):
    """torch's documented way: each worker yields its own share of the stream."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return iter(torch.arange(self.n)[worker::workers].unbind())


def test_a_data_set_that_shards_by_worker_is_not_split_again() -> None:
    """Split again, each worker would keep a share of its share: items dropped silently."""
    loader = DataLoader(_ShardsByWorker(10), batch_size=2, num_workers=2)
    kept = split_iterable_loader(loader, 0, 1, pin_memory=False)
    assert kept is loader
    assert sorted(int(i) for batch in kept for i in batch) == list(range(10))


def test_a_data_set_that_shards_by_worker_on_several_processes_is_refused() -> None:
    loader = DataLoader(_ShardsByWorker(10), batch_size=2, num_workers=2)
    with pytest.raises(UserError, match="splits its stream across DataLoader workers itself"):
        split_iterable_loader(loader, 0, 2, pin_memory=False)


def test_part_r_of_r_processes_keeps_every_rth_item_of_a_loader_without_batch_size() -> None:
    parts = [[int(i) for i in SplitIterable(_Stream(10), part, 3)] for part in range(3)]
    assert parts == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    plain = DataLoader(_Stream(4), batch_size=None)
    assert split_iterable_loader(plain, 0, 1, pin_memory=False) is plain


def _parts(
    n: int, batch: int, part: int, parts: int, **options: Any
) -> list[tuple[list[int], float]]:
    stream = GlobalBatches(
        _Stream(n), batch, part, parts, **{"drop_last": False, "evaluation": False, **options}
    )
    return [([int(i) for i in p.batch], p.weight) for p in stream]


def test_a_stream_is_cut_into_global_batches_and_each_process_takes_its_part() -> None:
    """Global batches of 4 from 0..9: [0-3], [4-7], [8, 9]; two processes take the halves;
    three take tensor_split's parts, and the one with no item of the last batch gets a
    stand-in (its first item) with a loss weight of 0."""
    assert _parts(10, 4, 0, 1) == [([0, 1, 2, 3], 1.0), ([4, 5, 6, 7], 1.0), ([8, 9], 1.0)]
    assert _parts(10, 4, 0, 2) == [([0, 1], 1.0), ([4, 5], 1.0), ([8], 1.0)]
    assert _parts(10, 4, 1, 2) == [([2, 3], 1.0), ([6, 7], 1.0), ([9], 1.0)]
    assert _parts(10, 4, 2, 3) == [([3], 0.75), ([7], 0.75), ([8], 0.0)]
    assert _parts(10, 4, 1, 3, drop_last=True) == [([2], 0.75), ([6], 0.75)]
    # evaluation: an empty part is skipped, never a stand-in
    assert _parts(10, 4, 2, 3, evaluation=True) == [([3], 0.75), ([7], 0.75)]
    split = GlobalBatches(_Stream(10), 4, 1, 2, drop_last=False, evaluation=False)
    split.start_batch = 1  # resumed: the batches before it are read past
    assert [[int(i) for i in p.batch] for p in split] == [[6, 7], [9]]


def test_a_split_loader_keeps_the_loaders_settings() -> None:
    def collate(batch: Any) -> Any:
        return batch

    told = DataLoader(_SplitsItself(4), batch_size=2, num_workers=2)
    assert split_iterable_loader(told, 1, 2, pin_memory=False) is told
    loader = DataLoader(
        _Stream(9),
        batch_size=2,
        drop_last=True,
        num_workers=2,
        collate_fn=collate,
        timeout=7,
        persistent_workers=True,
    )
    split = split_iterable_loader(loader, 1, 2, pin_memory=True, batch_size=4, evaluation=True)
    assert isinstance(split.dataset, GlobalBatches)
    stream = split.dataset
    assert (stream.part, stream.parts, stream.batch_size) == (1, 2, 4)
    assert stream.drop_last and stream.evaluation
    assert (split.batch_size, split.num_workers, split.timeout, split.pin_memory) == (
        None,
        2,
        7,
        True,
    )
    assert isinstance(split.collate_fn, CollateParts) and split.collate_fn.collate is collate
    # each iteration hands the workers the epoch and start it was told
    assert not split.persistent_workers


class _Sink:
    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate

    def handed_out(self, info: BatchInfo) -> None:
        pass

    def epoch_done(self) -> None:
        pass

    def restarted(self, source: int) -> None:
        pass


def _ends(n: int, accumulate: int) -> list[bool]:
    rebuilt, sampler = shard_loader(
        DataLoader(_Stream(n), batch_size=2),
        rank=0,
        world_size=1,
        seed=0,
        evaluation=False,
        pin_memory=False,
    )
    ends = []
    assert sampler is None
    for batch in StreamLoader(rebuilt, CPU, _Sink(accumulate)):
        info = batch_info(batch)
        assert info is not None
        ends.append(info.ends_epoch)
    return ends


def test_an_iterable_epochs_last_batch_is_known_where_micro_batches_accumulate() -> None:
    assert _ends(7, accumulate=2) == [False, False, False, True]
    assert _ends(0, accumulate=2) == []
    # one micro-batch per step: no batch is read ahead (and none needs to end the epoch)
    assert _ends(7, accumulate=1) == [False] * 4
