"""A user's webdataset pipeline split by its shards (:mod:`paratrain.data.wds_pipeline`):
shard ``i`` to process ``i % R``, then to the process's workers in turn; shuffle buffers
seeded from the run's seed, the epoch, the process and the worker; what cannot be split
said in one line."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from paratrain.data.loaders import pipeline_loader
from paratrain.data.pipeline_loader import PipelineLoader, batch_length
from paratrain.data.wds_pipeline import PipelinePart, is_pipeline, unwrap_web_loader
from paratrain.utils.errors import UserError

wds = pytest.importorskip("webdataset")

SIZES = (4, 3, 5, 2, 1, 3, 2)  # seven shards of uneven lengths


def _urls(folder: Path) -> list[str]:
    urls, number = [], 0
    for index, size in enumerate(SIZES):
        urls.append(str(folder / f"s-{index}.tar"))
        with wds.TarWriter(urls[-1]) as writer:
            for _ in range(size):
                writer.write({"__key__": f"{number:04d}", "cls": number})
                number += 1
    return urls


def _shard_of(number: int) -> int:
    bounds = list(itertools.accumulate(SIZES))
    return next(s for s, end in enumerate(bounds) if number < end)


def _numbers(part: PipelinePart) -> list[int]:
    return [int(n) for (n,) in part]


def test_shard_i_goes_to_process_i_mod_r_whatever_the_pipeline_says(tmp_path: Path) -> None:
    urls = _urls(tmp_path)
    # webdataset's own default refuses several processes; its split_by_node reads the
    # global rank: both are replaced by the process's place in the data
    for splitter in (wds.single_node_only, wds.split_by_node):
        pipeline = wds.WebDataset(urls, shardshuffle=False, nodesplitter=splitter)
        pipeline = pipeline.decode().to_tuple("cls")
        assert is_pipeline(pipeline)
        seen = []
        for part in range(3):
            numbers = _numbers(PipelinePart(pipeline, part, 3, seed=None))
            assert {_shard_of(n) for n in numbers} == set(range(part, len(SIZES), 3))
            seen += numbers
        assert sorted(seen) == list(range(sum(SIZES)))


def test_a_process_shards_go_to_its_workers_in_turn(tmp_path: Path) -> None:
    urls = _urls(tmp_path)
    pipeline = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("cls")
    part = PipelinePart(pipeline, 0, 2, seed=None)  # shards 0, 2, 4, 6
    assert [part.shards_of(w, 3) for w in range(3)] == [2, 1, 1]  # 0 and 6, 2, 4
    part = PipelinePart(pipeline, 1, 2, seed=None)  # shards 1, 3, 5
    assert [part.shards_of(w, 4) for w in range(4)] == [1, 1, 1, 0]
    loader = DataLoader(part, batch_size=None, num_workers=4, multiprocessing_context="fork")
    numbers = sorted(int(n) for (n,) in loader)  # a worker with no shard yields nothing
    assert {_shard_of(n) for n in numbers} == {1, 3, 5}
    assert len(numbers) == SIZES[1] + SIZES[3] + SIZES[5]


def test_shuffle_buffers_follow_the_run_seed_and_the_epoch(tmp_path: Path) -> None:
    urls = _urls(tmp_path)
    pipeline = wds.WebDataset(urls, shardshuffle=3).shuffle(10).decode().to_tuple("cls")
    part = PipelinePart(pipeline, 0, 1, seed=7)
    first = _numbers(part)
    assert _numbers(part) == first  # the same epoch again: a resume reads the same order
    part.epoch = 1
    assert _numbers(part) != first and sorted(_numbers(part)) == sorted(first)
    other = PipelinePart(pipeline, 0, 1, seed=8)
    assert _numbers(other) != first


def test_a_deterministic_shard_shuffle_is_told_the_epoch(tmp_path: Path) -> None:
    urls = _urls(tmp_path)

    def part(epoch: int) -> PipelinePart:  # a new pipeline: a process started to resume
        made = wds.WebDataset(urls, shardshuffle=5, detshuffle=True).decode().to_tuple("cls")
        stream = PipelinePart(made, 0, 1, seed=7)
        stream.epoch = epoch
        return stream

    running = part(0)
    orders = []
    for epoch in range(3):
        running.epoch = epoch
        orders.append(_numbers(running))
    assert orders[1] != orders[2]
    assert [_numbers(part(epoch)) for epoch in range(3)] == orders


def test_what_cannot_be_split_is_said_in_one_line(tmp_path: Path) -> None:
    urls = _urls(tmp_path)
    pipeline = wds.WebDataset(urls, shardshuffle=False).to_tuple("cls")
    after = wds.WebLoader(pipeline, batch_size=2).unbatched().shuffle(5).batched(2)
    with pytest.raises(UserError, match="stages after its DataLoader"):
        unwrap_web_loader(after)
    alone = wds.WebLoader(pipeline, batch_size=2)
    assert isinstance(unwrap_web_loader(alone), DataLoader)
    samples = wds.DataPipeline(lambda: iter([{"cls": b"1"}]), wds.to_tuple("cls"))
    with pytest.raises(UserError, match="not a list of shards"):
        PipelinePart(samples, 0, 2, seed=None)


def test_a_resampled_source_is_not_split_and_has_no_end(tmp_path: Path) -> None:
    urls = _urls(tmp_path)
    pipeline = wds.WebDataset(urls, resampled=True, shardshuffle=False).decode().to_tuple("cls")
    part = PipelinePart(pipeline, 1, 2, seed=None)
    assert not part.bounded
    assert len(list(itertools.islice(iter(part), 3 * sum(SIZES)))) == 3 * sum(SIZES)


def test_a_batch_length_is_its_first_tensor_s() -> None:
    assert batch_length((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_length({"x": [torch.zeros(3)]}) == 3
    assert batch_length(torch.tensor(1.0)) == 1


@pytest.mark.parametrize(
    ("seed", "resampled", "says"),
    [
        (3, False, "exact: its shuffle buffers are seeded from the run's seed"),
        (None, False, "not exact: with no run seed"),
        (None, True, "draws its shards without end: no epoch ends"),
    ],
)
def test_setup_says_in_one_line_what_is_exact(
    seed: int | None, resampled: bool, says: str, tmp_path: Path
) -> None:
    urls = _urls(tmp_path)
    pipeline = wds.WebDataset(urls, shardshuffle=False, resampled=resampled).to_tuple("cls")
    made = pipeline_loader(DataLoader(pipeline, batch_size=4), 1, 2, seed, pin_memory=False)
    note = PipelineLoader(made, torch.device("cpu"), None, None, False).note(2, 0)
    assert says in note and "\n" not in note
    assert resampled or "7 shards go to 2 process(es) x 1 worker(s)" in note
    assert made.batch_size == 2  # a global batch of 4: this process's part of it
