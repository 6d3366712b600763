"""Sharded batches: every layout sees the same global batches."""

from __future__ import annotations

import pytest
import torch

from paratrain.errors import UserError
from paratrain.loaders import ShardedBatchSampler


def _parts(n: int, batch: int, world: int, **kwargs: object) -> list[list[list[int]]]:
    samplers = [
        ShardedBatchSampler(n, batch, rank=r, world_size=world, seed=5, **kwargs)  # type: ignore[arg-type]
        for r in range(world)
    ]
    return [list(s) for s in samplers]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_together_see_the_one_process_batches(world: int) -> None:
    single = _parts(96, 12, 1, shuffle=True)[0]
    per_rank = _parts(96, 12, world, shuffle=True)
    assert all(len(batches) == len(single) for batches in per_rank)
    for index, batch in enumerate(single):
        union = [i for batches in per_rank for i in batches[index]]
        assert sorted(union) == sorted(batch)


def test_uneven_last_batch_is_split_and_weighted_exactly() -> None:
    sampler = ShardedBatchSampler(13, 4, shuffle=False, seed=0, rank=1, world_size=3)
    assert sampler.global_batch_sizes() == [4, 4, 4]  # last batch of 1 < 3 processes: dropped
    sampler = ShardedBatchSampler(14, 4, shuffle=False, seed=0, rank=0, world_size=3)
    assert sampler.global_batch_sizes() == [4, 4, 4]
    sampler = ShardedBatchSampler(14, 4, shuffle=False, seed=0, world_size=2)
    assert sampler.global_batch_sizes() == [4, 4, 4, 2]
    sampler = ShardedBatchSampler(15, 4, shuffle=False, seed=0, rank=0, world_size=3)
    assert sampler.global_batch_sizes() == [4, 4, 4, 3]
    assert [sampler.local_size(4), sampler.local_size(3)] == [2, 1]


def test_training_drops_a_last_batch_smaller_than_the_world() -> None:
    per_rank = _parts(13, 4, 3, shuffle=False)
    assert [len(b) for b in per_rank] == [3, 3, 3]


def test_evaluation_sees_every_sample_exactly_once() -> None:
    per_rank = _parts(1000, 64, 3, shuffle=False, evaluation=True)
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(seen) == list(range(1000))


def test_epochs_change_the_order_and_start_batch_skips() -> None:
    sampler = ShardedBatchSampler(20, 5, shuffle=True, seed=1)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    sampler.set_epoch(1, start_batch=2)
    assert list(sampler) == second[2:]
    assert len(sampler) == 2


def test_batch_smaller_than_world_is_refused() -> None:
    with pytest.raises(UserError, match="at least 4"):
        ShardedBatchSampler(10, 2, shuffle=False, seed=0, world_size=4)


def test_permutation_matches_torch_randperm_seeding() -> None:
    sampler = ShardedBatchSampler(10, 10, shuffle=True, seed=7)
    sampler.set_epoch(2)
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(9)).tolist()
    assert next(iter(sampler)) == expected
