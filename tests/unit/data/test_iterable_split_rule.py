"""An IterableDataset split by item across workers and processes (the rule of
:mod:`paratrain.data.iterable_split`), and the end of its epoch seen one batch ahead only
where accumulated micro-batches need it. Workers as real processes:
tests/integration/test_iterable_split.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from paratrain.data.iterable_split import SplitIterable, split_iterable_loader
from paratrain.data.loaders import BatchInfo, DeviceLoader, batch_info, shard_loader
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


def test_part_r_of_r_processes_keeps_every_rth_item() -> None:
    parts = [[int(i) for i in SplitIterable(_Stream(10), part, 3)] for part in range(3)]
    assert parts == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_a_loader_with_nothing_to_split_is_kept_and_one_split_keeps_its_settings() -> None:
    plain = DataLoader(_Stream(4), batch_size=2)
    assert split_iterable_loader(plain, 0, 1, pin_memory=False) is plain
    told = DataLoader(_SplitsItself(4), batch_size=2, num_workers=2)
    assert split_iterable_loader(told, 1, 2, pin_memory=False) is told

    def collate(batch: Any) -> Any:
        return batch

    loader = DataLoader(
        _Stream(9), batch_size=2, drop_last=True, num_workers=2, collate_fn=collate, timeout=7
    )
    split = split_iterable_loader(loader, 1, 2, pin_memory=True)
    assert isinstance(split.dataset, SplitIterable)
    assert (split.dataset.part, split.dataset.parts) == (1, 2)
    assert (split.batch_size, split.drop_last, split.num_workers) == (2, True, 2)
    assert (split.collate_fn, split.timeout, split.pin_memory) == (collate, 7, True)


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
    for batch in DeviceLoader(rebuilt, CPU, sampler, _Sink(accumulate)):
        info = batch_info(batch)
        assert info is not None
        ends.append(info.ends_epoch)
    return ends


def test_an_iterable_epochs_last_batch_is_known_where_micro_batches_accumulate() -> None:
    assert _ends(7, accumulate=2) == [False, False, False, True]
    assert _ends(0, accumulate=2) == []
    # one micro-batch per step: no batch is read ahead (and none needs to end the epoch)
    assert _ends(7, accumulate=1) == [False] * 4
