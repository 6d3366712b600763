"""Iterable and sharded data through ``rt.setup_loader`` on real processes (gloo), 103
numbered samples in global batches of 17 (six, and a last one of a single sample): every
sample once an epoch on one process and on two, with 0 and 2 DataLoader workers, the same
weights on both layouts, evaluation counting 103; and a run stopped mid-epoch, resumed from
``rt.save``'s file, seeing exactly the samples it had left (without opening the shards
already read) and ending with the uninterrupted run's weights, bit for bit.

Before: training on an IterableDataset was refused on several processes ("needs a map-style
dataset"), and a loader of one kept no position ``rt.save`` could return to."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import paratrain
from paratrain.data.loaders import batch_info

pytestmark = pytest.mark.slow  # real processes and DataLoader workers
shards = pytest.importorskip("paratrain.data.shards")
pytest.importorskip("webdataset")

SAMPLES, BATCH, PER_SHARD = 103, 17, 20
STEPS_PER_EPOCH = 7  # six global batches of 17, and one of 1


class Numbered(IterableDataset):  # type: ignore[type-arg]
    """Samples ``(x, i)`` for i in 0..102: a plain stream with no length."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(SAMPLES):
            yield torch.tensor([i / SAMPLES]), torch.tensor(i)


class CountedShards(shards.ShardStream):  # type: ignore[misc,name-defined]
    """Shards whose every opening is written down (by any process or worker)."""

    log = ""

    def open_shard(self, path: str) -> IO[bytes]:
        with open(self.log, "a") as log:
            log.write(Path(path).name + "\n")
        return super().open_shard(path)


def write_numbered_shards(folder: Path) -> None:
    x = (torch.arange(SAMPLES) / SAMPLES).unsqueeze(1)
    shards.write_shards(folder, {"train": TensorDataset(x, torch.arange(SAMPLES))}, PER_SHARD)


def _source(kind: str, folder: str) -> IterableDataset:  # type: ignore[type-arg]
    if kind == "stream":
        return Numbered()
    if kind == "hf":  # Hugging Face datasets' iterable data set, in 4 shards
        return _hf().to_iterable_dataset(num_shards=4)  # type: ignore[no-any-return]
    if kind == "hf-map":  # and its map-style one: the path of any map-style data set
        return _hf()  # type: ignore[no-any-return]
    stream = CountedShards.from_folder(folder, shuffle=True, seed=3)
    stream.log = str(Path(folder) / "opened.log")
    return stream


def _hf() -> Any:
    """103 numbered rows as a Hugging Face data set (tensors)."""
    datasets = pytest.importorskip("datasets")
    rows = {"x": [[i / SAMPLES] for i in range(SAMPLES)], "i": list(range(SAMPLES))}
    return datasets.Dataset.from_dict(rows).with_format("torch")


def _fields(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's inputs and sample numbers (a tuple, or Hugging Face's dict)."""
    return (batch["x"].float(), batch["i"]) if isinstance(batch, dict) else batch


def _setup(rt: paratrain.Runtime, kind: str, folder: str, workers: int) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    made = DataLoader(_source(kind, folder), batch_size=BATCH, **_workers(workers))
    return model, optimizer, rt.setup_loader(made)


def _workers(workers: int) -> dict[str, Any]:
    """Real worker processes, forked (a forkserver's start imports torch anew each epoch)."""
    return {"num_workers": workers, "multiprocessing_context": "fork" if workers else None}


def _train(
    rt: paratrain.Runtime, model: Any, optimizer: Any, loader: Any, stop: int | None = None
) -> list[int]:
    """Train on ``loader``'s epoch (up to ``stop`` batches); the samples it trained on
    (a stand-in is none)."""
    seen = []
    for index, batch in enumerate(loader):
        x, i = _fields(batch)
        info = batch_info(x)
        assert info is not None
        if not info.stand_in:
            seen += i.tolist()
        rt.backward((model(x) - x.sin()).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        if stop is not None and index + 1 == stop:
            break
    return seen


def _counts(rt: paratrain.Runtime, seen: list[int]) -> list[int]:
    """How often each sample came, summed over the processes."""
    counts = torch.zeros(SAMPLES, dtype=torch.int64)
    counts.index_add_(
        0, torch.tensor(seen, dtype=torch.int64), torch.ones(len(seen), dtype=torch.int64)
    )
    return rt.all_reduce(counts).tolist()


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _epochs(rt: paratrain.Runtime, kind: str, folder: str) -> dict[str, Any]:
    """Two epochs with 0 and with 2 workers: the counts per epoch, the evaluation's count,
    the number of batches and the final weights."""
    out: dict[str, Any] = {}
    for workers in (0, 2):
        model, optimizer, loader = _setup(rt, kind, folder, workers)
        counts = [_counts(rt, _train(rt, model, optimizer, loader)) for _ in range(2)]
        evaluated = DataLoader(_source(kind, folder), batch_size=BATCH, **_workers(workers))
        with torch.no_grad():
            seen = [
                int(i)
                for batch in rt.setup_loader(evaluated, evaluation=True)
                for i in _fields(batch)[1]
            ]
        out[f"w{workers}"] = {
            "counts": counts,
            "evaluated": _counts(rt, seen),
            "steps": rt.state.step,
            "weights": _weights(model),
        }
        rt.state.step = 0
    return out


@pytest.mark.parametrize("kind", ["stream", "shards", "hf", "hf-map"])
def test_each_sample_once_an_epoch_and_the_same_weights_on_one_process_and_two(
    kind: str, tmp_path: Path
) -> None:
    write_numbered_shards(tmp_path)
    alone = _epochs(paratrain.Runtime(strategy="cpu"), kind, str(tmp_path))
    pair = paratrain.Runtime(strategy="ddp", devices="cpu,cpu").launch(_epochs, kind, str(tmp_path))
    assert pair is not None
    for run in (alone, pair):
        for workers in ("w0", "w2"):
            result = run[workers]
            assert result["counts"] == [[1] * SAMPLES] * 2, workers
            assert result["evaluated"] == [1] * SAMPLES, workers
            assert result["steps"] == 2 * STEPS_PER_EPOCH
    # the same global batches whatever the workers, and on both layouts
    for a, b in zip(alone["w0"]["weights"], alone["w2"]["weights"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(alone["w0"]["weights"], pair["w2"]["weights"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _stopped_and_resumed(
    rt: paratrain.Runtime, kind: str, folder: str, workers: int, stops: list[tuple[int, int]]
) -> dict[str, Any]:
    """Two epochs, stopped at each ``(epoch, batch)`` of ``stops``, saved with rt.save and
    resumed in fresh objects; what each resumed part trained on, and the shards opened in
    the rest of the epoch it resumed in."""
    path = Path(folder) / "resume.pt"  # written by the main process, read by each
    model, optimizer, loader = _setup(rt, kind, folder, workers)
    after: list[dict[str, Any]] = []
    at = (0, 0)
    for stop in [*stops, (2, 0)]:
        seen: list[int] = []
        while at < stop:
            batches = stop[1] - at[1] if at[0] == stop[0] else None
            seen += _train(rt, model, optimizer, loader, batches)
            at = (at[0] + 1, 0) if batches is None else stop
            if after and "opened" not in after[-1]:
                after[-1]["opened"] = _opened(folder, rt)
        if after:
            after[-1]["seen"] = _counts(rt, seen)
        if stop == (2, 0):
            break
        rt.save(path, {"model": model, "optimizer": optimizer, "loader": loader})
        model, optimizer, loader = _setup(rt, kind, folder, workers)
        rt.load(path, into={"model": model, "optimizer": optimizer, "loader": loader})
        assert loader.state_dict() == {"epoch": stop[0], "batch": stop[1]}
        _opened(folder, rt)  # what opened before the resume is not counted
        after.append({"at": stop})
    return {"after": after, "weights": _weights(model)}


def _opened(folder: str, rt: paratrain.Runtime) -> list[str]:
    """The shards opened since the last call, by any process (then forgotten)."""
    rt.barrier()
    log = Path(folder) / "opened.log"
    names = log.read_text().split() if log.exists() else []
    rt.barrier()
    if rt.is_main and log.exists():
        log.unlink()
    rt.barrier()
    return names


def _uninterrupted(rt: paratrain.Runtime, kind: str, folder: str, workers: int) -> Any:
    model, optimizer, loader = _setup(rt, kind, folder, workers)
    for _ in range(2):
        _train(rt, model, optimizer, loader)
    return _weights(model)


STOPS = [(0, 4), (1, 2), (1, 5)]  # once in epoch 0, twice in epoch 1


def _expected(kind: str, folder: Path, start: tuple[int, int], stop: tuple[int, int]) -> list[int]:
    """How often each sample lies between two positions (epoch, global batch) of the run."""
    counts = [0] * SAMPLES
    for epoch in range(start[0], stop[0] + 1):
        if kind != "shards":
            order = list(range(SAMPLES))
        else:
            stream = _source("shards", str(folder))
            order = [int(i) for _, i in stream.read([(0, SAMPLES)], epoch)]
        first = start[1] * BATCH if epoch == start[0] else 0
        last = stop[1] * BATCH if epoch == stop[0] else SAMPLES
        for i in order[first:last]:
            counts[i] += 1
    return counts


def _check_resumed(result: dict[str, Any], kind: str, folder: Path) -> None:
    """After each stop, exactly the samples the run had left up to the next; no shard
    opened whose samples were all consumed."""
    stream = _source("shards", str(folder))
    ends = [part["at"] for part in result["after"][1:]] + [(2, 0)]
    for part, end in zip(result["after"], ends, strict=True):
        epoch, batch = part["at"]
        assert part["seen"] == _expected(kind, folder, (epoch, batch), end), part["at"]
        if kind == "shards":
            consumed, first = [], 0
            for shard in stream.shard_order(epoch):
                first += stream.shards[shard].samples
                if first <= batch * BATCH:
                    consumed.append(Path(stream.shards[shard].path).name)
            assert part["opened"] and not set(consumed) & set(part["opened"]), part


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["stream", "shards"])
def test_a_run_stopped_mid_epoch_resumes_with_exactly_the_samples_left(
    kind: str, workers: int, tmp_path: Path
) -> None:
    write_numbered_shards(tmp_path)
    folder = str(tmp_path)
    for rt in (
        paratrain.Runtime(strategy="cpu"),
        paratrain.Runtime(strategy="ddp", devices="cpu,cpu"),
    ):
        whole = rt.launch(_uninterrupted, kind, folder, workers)
        resumed = rt.launch(_stopped_and_resumed, kind, folder, workers, STOPS)
        assert whole is not None and resumed is not None
        _check_resumed(resumed, kind, tmp_path)
        for a, b in zip(whole, resumed["weights"], strict=True):
            assert torch.equal(a, b)
