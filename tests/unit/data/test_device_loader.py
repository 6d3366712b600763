"""What a loop sees through ``rt.setup_loader``'s DeviceLoader in this process (`--strategy
cpu`; the ranks of `cpu,cpu,cpu` simulated one at a time): loss weights, the last-batch
signal, epochs, and the DataLoader settings that sharding keeps. The data paths' tests
compare paths with one another; these pin the values themselves."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, SubsetRandomSampler, TensorDataset

from paratrain.data.loaders import (
    BatchInfo,
    DeviceLoader,
    ShardedBatchSampler,
    batch_info,
    shard_loader,
)
from paratrain.utils.errors import UserError

CPU = torch.device("cpu")


def _data(n: int = 15) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _device_loader(
    rank: int, world: int, sink: Any, n: int = 15, evaluation: bool = False
) -> DeviceLoader:
    loader = DataLoader(_data(n), batch_size=4, shuffle=False)
    rebuilt, sampler = shard_loader(
        loader, rank=rank, world_size=world, seed=0, evaluation=evaluation, pin_memory=False
    )
    return DeviceLoader(rebuilt, CPU, sampler, sink)


class _Sink:
    """What the runtime's step state is told: each batch handed out, each restart."""

    def __init__(self, accumulate: int = 1) -> None:
        self.accumulate = accumulate
        self.handed: list[BatchInfo] = []
        self.restarts = 0

    def handed_out(self, info: BatchInfo) -> None:
        self.handed.append(info)

    def epoch_done(self) -> None:
        pass

    def restarted(self, source: int) -> None:
        self.restarts += 1


def _signals(loader: DeviceLoader) -> list[tuple[list[int], float, bool]]:
    """Each batch's samples and what it carries: its loss weight, whether it ends the epoch."""
    signals = []
    for batch in loader:
        info = batch_info(batch)
        assert info is not None
        signals.append((batch[0].tolist(), info.loss_weight, info.ends_epoch))
    return signals


def test_loss_weights_make_the_mean_of_ranks_the_global_mean() -> None:
    # 15 samples in batches of 4 on 3 processes: 4, 4, 4, 3 split 2-1-1 and 1-1-1
    sink = _Sink()
    loader = _device_loader(0, 3, sink)
    expected = [([0, 1], 1.5, False), ([4, 5], 1.5, False), ([8, 9], 1.5, False), ([12], 1.0, True)]
    assert _signals(loader) == expected
    # the sink heard of each batch as it was handed out, and of the epoch's start
    assert [(i.loss_weight, i.ends_epoch) for i in sink.handed] == [e[1:] for e in expected]
    assert sink.restarts == 1
    loader.set_epoch(1, start_batch=2)
    assert _signals(loader) == [([8, 9], 1.5, False), ([12], 1.0, True)]
    assert [w for _, w, _ in _signals(_device_loader(2, 3, _Sink()))] == [0.75, 0.75, 0.75, 1.0]


def test_one_process_or_no_sink_sets_no_weights() -> None:
    assert [w for _, w, _ in _signals(_device_loader(0, 1, _Sink()))] == [1.0] * 4
    assert _device_loader(0, 3, None)._loss_weights() is None
    evaluation = _device_loader(0, 3, None, evaluation=True)
    assert all(batch_info(b) is None for b in evaluation)  # only training batches carry it


def test_epochs_advance_by_one_unless_pinned() -> None:
    loader = _device_loader(0, 1, None)
    assert loader.epoch == 0
    list(loader)
    list(loader)
    assert loader.epoch == 1
    loader.set_epoch(5)
    assert len(list(loader)) == 4  # the whole epoch: no batch skipped unless told
    assert loader.epoch == 5
    list(loader)
    assert loader.epoch == 6
    plain = DeviceLoader(DataLoader(_data(), batch_size=4), CPU, None)  # no sampler of ours
    assert plain.epoch == -1 and plain.evaluation
    list(plain)
    assert plain.epoch == 0
    plain.set_epoch(3)
    list(plain)
    assert plain.epoch == 3


def test_an_iteration_under_no_grad_is_reported() -> None:
    loader, seen = _device_loader(0, 1, None), []
    loader.on_no_grad = seen.append
    list(loader)
    assert seen == []  # a training loop's iteration
    with torch.no_grad():
        list(loader)
    assert seen == [loader]
    with torch.no_grad():  # nobody listening: nothing to call
        assert len(list(_device_loader(0, 1, None))) == 4
    assert not loader.evaluation and _device_loader(0, 1, None, evaluation=True).evaluation
    assert loader.dataset is loader.loader.dataset and len(loader) == 4


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter(range(4))


def test_loaders_that_cannot_be_split_are_kept_for_one_process_and_refused_for_more() -> None:
    stream = DataLoader(_Stream(), batch_size=None)  # batches of its own: items split
    subset = DataLoader(_data(), batch_size=2, sampler=SubsetRandomSampler([0, 1]))
    unbatched = DataLoader(_data(), batch_size=None)
    for loader, message in [
        (stream, "needs the loader to split the _Stream itself"),
        (unbatched, "loader with batch_size"),
        (subset, "SubsetRandomSampler"),
    ]:
        kept = shard_loader(
            loader, rank=0, world_size=1, seed=0, evaluation=False, pin_memory=False
        )
        assert kept == (loader, None)
        with pytest.raises(UserError, match=message):
            shard_loader(loader, rank=0, world_size=2, seed=0, evaluation=False, pin_memory=False)


def test_sharding_keeps_the_loaders_settings() -> None:
    def collate(batch: Any) -> Any:
        return batch

    def init(worker: int) -> None:
        pass

    loader = DataLoader(
        _data(),
        batch_size=4,
        shuffle=True,
        drop_last=True,
        collate_fn=collate,
        timeout=7,
        worker_init_fn=init,
    )
    rebuilt, sampler = shard_loader(
        loader, rank=1, world_size=2, seed=3, evaluation=True, pin_memory=True, batch_size=6
    )
    assert sampler is not None and rebuilt.batch_sampler is sampler
    assert (sampler.num_samples, sampler.batch_size, sampler.rank, sampler.world_size) == (
        15,
        6,
        1,
        2,
    )
    assert (sampler.shuffle, sampler.seed, sampler.drop_last, sampler.evaluation) == (
        True,
        3,
        True,
        True,
    )
    assert rebuilt.collate_fn is collate and rebuilt.worker_init_fn is init
    assert rebuilt.timeout == 7 and rebuilt.pin_memory and rebuilt.prefetch_factor is None
    assert rebuilt.generator is not None and rebuilt.generator.initial_seed() == 3
    plain, sampler = shard_loader(
        DataLoader(_data(), batch_size=4),
        rank=0,
        world_size=1,
        seed=None,
        evaluation=False,
        pin_memory=False,
    )
    assert sampler is not None and not sampler.shuffle and sampler.batch_size == 4
    assert not plain.pin_memory and plain.generator is None


def test_the_loaders_own_generator_is_kept_and_replacement_warns() -> None:
    generator = torch.Generator().manual_seed(1)
    loader = DataLoader(_data(), batch_size=4, shuffle=True, generator=generator)
    for seed in (None, 9):
        rebuilt, sampler = shard_loader(
            loader, rank=0, world_size=1, seed=seed, evaluation=False, pin_memory=False
        )
        assert rebuilt.generator is generator and sampler is not None
        assert sampler.generator is generator
    with_replacement = DataLoader(
        _data(), batch_size=4, sampler=torch.utils.data.RandomSampler(_data(), replacement=True)
    )
    with pytest.warns(UserWarning, match="^sampling with replacement is replaced by a shuffle$"):
        shard_loader(
            with_replacement, rank=0, world_size=1, seed=0, evaluation=False, pin_memory=False
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard_loader(loader, rank=0, world_size=1, seed=0, evaluation=False, pin_memory=False)


def test_sharding_keeps_the_workers_settings_and_passes_agree_on() -> None:
    def agree(drawn: int) -> int:
        return drawn

    loader = DataLoader(
        _data(),
        batch_size=4,
        shuffle=True,
        num_workers=1,
        prefetch_factor=3,
        persistent_workers=True,
        multiprocessing_context="spawn",
    )  # no worker starts until iterated
    rebuilt, sampler = shard_loader(
        loader, rank=0, world_size=1, seed=None, evaluation=False, pin_memory=False, agree=agree
    )
    assert sampler is not None and sampler.agree is agree
    assert rebuilt.num_workers == 1 and rebuilt.prefetch_factor == 3 and rebuilt.persistent_workers
    assert rebuilt.multiprocessing_context is loader.multiprocessing_context


def test_rank_0s_draw_is_what_every_rank_agrees_on() -> None:
    told: list[int] = []
    sampler = ShardedBatchSampler(
        6, 6, shuffle=True, seed=None, agree=lambda d: told.append(d) or d
    )
    torch.manual_seed(2)
    drawn = int(torch.empty((), dtype=torch.int64).random_().item())
    torch.manual_seed(2)
    sampler.order()
    assert told == [drawn]


def test_loaders_that_cannot_be_split_say_how_to_build_one() -> None:
    with pytest.raises(UserError) as raised:
        shard_loader(
            DataLoader(_Stream(), batch_size=None),
            rank=0,
            world_size=2,
            seed=0,
            evaluation=False,
            pin_memory=False,
        )
    assert str(raised.value) == (
        "training on 2 processes needs the loader to split the _Stream itself: build the "
        "DataLoader with a batch_size and a data set that does not split itself (see 'Data "
        "at scale' in the docs), or use a map-style dataset"
    )
    subset = DataLoader(_data(), batch_size=2, sampler=SubsetRandomSampler([0, 1]))
    with pytest.raises(UserError) as raised:
        shard_loader(subset, rank=0, world_size=2, seed=0, evaluation=False, pin_memory=False)
    assert str(raised.value) == (
        "the loader's sampler SubsetRandomSampler cannot be split across processes; "
        "build the DataLoader with shuffle=True or shuffle=False instead"
    )
