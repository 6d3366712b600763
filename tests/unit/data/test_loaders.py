"""Sharded batches: every layout sees the same global batches."""

from __future__ import annotations

import pytest
import torch

from paratrain.data.loaders import ShardedBatchSampler
from paratrain.utils.errors import UserError


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
    assert sampler.global_batch_sizes() == [4, 4, 4, 1]  # 1 < 3 processes: kept (stand-ins)
    assert [sampler.local_size(4), sampler.local_size(1)] == [1, 0]
    sampler = ShardedBatchSampler(14, 4, shuffle=False, seed=0, rank=0, world_size=3)
    assert sampler.global_batch_sizes() == [4, 4, 4, 2]
    sampler = ShardedBatchSampler(14, 4, shuffle=False, seed=0, world_size=2)
    assert sampler.global_batch_sizes() == [4, 4, 4, 2]
    sampler = ShardedBatchSampler(15, 4, shuffle=False, seed=0, rank=0, world_size=3)
    assert sampler.global_batch_sizes() == [4, 4, 4, 3]
    assert [sampler.local_size(4), sampler.local_size(3)] == [2, 1]


def test_training_keeps_a_last_batch_smaller_than_the_world_with_stand_ins() -> None:
    """Every process takes the last step: one without a sample of it gets the batch's first
    sample as a stand-in (weighted 0 by the loader), so no sample is dropped."""
    per_rank = _parts(13, 4, 3, shuffle=False)
    assert [len(b) for b in per_rank] == [4, 4, 4]
    assert [b[-1] for b in per_rank] == [[12], [12], [12]]  # rank 0's sample; 1, 2 stand in
    assert [
        len(ShardedBatchSampler(13, 4, shuffle=False, seed=0, rank=r, world_size=3))
        for r in range(3)
    ] == [4, 4, 4]
    real = [batch for rank, b in enumerate(per_rank) for batch in b if rank == 0 or batch != [12]]
    assert sorted(i for batch in real for i in batch) == list(range(13))


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


def test_drop_last_and_evaluation_decide_the_last_batch() -> None:
    def sizes(n: int, world: int, **kwargs: bool) -> list[int]:
        return ShardedBatchSampler(
            n, 4, shuffle=False, seed=0, world_size=world, **kwargs
        ).global_batch_sizes()

    assert sizes(14, 2, drop_last=True) == [4, 4, 4]
    assert sizes(14, 2, drop_last=True, evaluation=True) == [4, 4, 4]
    assert sizes(13, 3, evaluation=True) == [4, 4, 4, 1]  # smaller than the world: still seen
    assert sizes(12, 3, evaluation=True) == [4, 4, 4]


def test_each_rank_gets_its_tensor_split_part_and_skips_an_empty_one() -> None:
    parts = [
        ShardedBatchSampler(13, 4, shuffle=False, seed=0, rank=r, world_size=3, evaluation=True)
        for r in range(3)
    ]
    assert [p.local_span(5) for p in parts] == [(0, 2), (2, 4), (4, 5)]
    assert [list(p) for p in parts] == [
        [[0, 1], [4, 5], [8, 9], [12]],
        [[2], [6], [10]],
        [[3], [7], [11]],  # its part of the last batch (one sample) is empty
    ]
    assert [len(p) for p in parts] == [4, 3, 3]
    parts[0].set_epoch(0, start_batch=1)
    assert list(parts[0]) == [[4, 5], [8, 9], [12]] and len(parts[0]) == 3
    # evaluation takes any batch size; training needs one sample per process at least, and
    # trains on the last batch of 2 samples with stand-ins on ranks 2 and 3
    assert (
        len(ShardedBatchSampler(10, 2, shuffle=False, seed=0, world_size=4, evaluation=True)) == 5
    )
    assert len(ShardedBatchSampler(10, 4, shuffle=False, seed=0, world_size=4)) == 3


def test_unseeded_orders_come_from_the_loaders_generator_or_rank_0s_draw() -> None:
    generator, copy = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    sampler = ShardedBatchSampler(10, 10, shuffle=True, seed=None, generator=generator)
    assert sampler.order().tolist() == torch.randperm(10, generator=copy).tolist()
    agreed = ShardedBatchSampler(10, 10, shuffle=True, seed=None, agree=lambda drawn: 123)
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(123)).tolist()
    assert agreed.order().tolist() == expected
    torch.manual_seed(4)
    drawn = int(torch.empty((), dtype=torch.int64).random_().item())
    torch.manual_seed(4)
    unseeded = ShardedBatchSampler(10, 10, shuffle=True, seed=None).order().tolist()
    assert unseeded == torch.randperm(10, generator=torch.Generator().manual_seed(drawn)).tolist()
    assert ShardedBatchSampler(4, 2, shuffle=False, seed=None).order().tolist() == [0, 1, 2, 3]


def test_an_epoch_draws_from_the_loaders_generator_as_random_sampler_does() -> None:
    from torch.utils.data import RandomSampler

    generator, reference = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    sampler = ShardedBatchSampler(8, 4, shuffle=True, seed=None, generator=generator)
    assert sorted(i for batch in sampler for i in batch) == list(range(8))
    list(RandomSampler(range(8), generator=reference))  # a permutation, then an empty one
    assert torch.equal(generator.get_state(), reference.get_state())
    before = generator.get_state()
    for unshuffled in (
        ShardedBatchSampler(8, 4, shuffle=False, seed=None, generator=generator),
        ShardedBatchSampler(8, 4, shuffle=True, seed=1, generator=generator),  # seeded: its own
    ):
        list(unshuffled)
        assert torch.equal(generator.get_state(), before)
