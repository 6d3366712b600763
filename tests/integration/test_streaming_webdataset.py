"""A user's own webdataset pipeline (``wds.WebDataset(urls).shuffle(N).decode().to_tuple``,
and ``wds.WebLoader``) through ``rt.setup_loader`` on two real processes (gloo): 103
numbered samples in five shards of uneven lengths (30, 25, 20, 18, 10), so the processes'
parts differ (60 and 43 samples). Every sample once an epoch with 0 and 2 workers,
evaluation counting 103, and a run stopped and resumed three times (twice in one epoch)
training on exactly the batches the uninterrupted run did, ending with its weights bit for
bit.

Before: on several processes the pipeline was refused ("splits its stream across
DataLoader workers itself"), and on one its loader kept no position to resume from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import paratrain
from paratrain.data.loaders import batch_info

pytestmark = pytest.mark.slow  # real processes and DataLoader workers
wds = pytest.importorskip("webdataset")

SAMPLES, BATCH, SHARDS = 103, 8, (30, 25, 20, 18, 10)


def write_shards(folder: Path) -> list[str]:
    urls, number = [], 0
    for index, size in enumerate(SHARDS):
        url = str(folder / f"part-{index}.tar")
        with wds.TarWriter(url) as writer:
            for _ in range(size):
                writer.write({"__key__": f"{number:06d}", "cls": number})
                number += 1
        urls.append(url)
    return urls


def _loader(urls: list[str], workers: int, web_loader: bool = False) -> Any:
    pipeline = wds.WebDataset(urls, shardshuffle=2).shuffle(16).decode().to_tuple("cls")
    settings: dict[str, Any] = {
        "batch_size": BATCH,
        "num_workers": workers,
        "multiprocessing_context": "fork" if workers else None,
    }
    return wds.WebLoader(pipeline, **settings) if web_loader else DataLoader(pipeline, **settings)


def _setup(rt: paratrain.Runtime, urls: list[str], workers: int, web_loader: bool) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    return model, optimizer, rt.setup_loader(_loader(urls, workers, web_loader))


def _train(
    rt: paratrain.Runtime,
    model: Any,
    optimizer: Any,
    loader: Any,
    stop: Any,
    weights: list[float] | None = None,
) -> Any:
    """Up to ``stop`` steps of ``loader``'s epoch (all: None); the samples of each step's
    batch on this process (none for a stand-in), each step's loss weight into ``weights``."""
    steps: list[list[int]] = []
    for index, (i,) in enumerate(loader):
        info = batch_info(i)
        assert info is not None
        steps.append([] if info.stand_in else i.tolist())
        if weights is not None:
            weights.append(info.loss_weight)
        x = i.float().unsqueeze(1) / SAMPLES
        rt.backward((model(x) - x.sin()).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        if index + 1 == stop:
            break
    return steps


def _counts(rt: paratrain.Runtime, steps: list[list[int]]) -> list[int]:
    seen = torch.tensor([i for step in steps for i in step], dtype=torch.int64)
    counts = torch.zeros(SAMPLES, dtype=torch.int64).index_add_(0, seen, torch.ones_like(seen))
    return rt.all_reduce(counts).tolist()


def _epochs(rt: paratrain.Runtime, urls: list[str], workers: int, web_loader: bool) -> Any:
    model, optimizer, loader = _setup(rt, urls, workers, web_loader)
    weights: list[float] = []
    epochs = [_train(rt, model, optimizer, loader, None, weights) for _ in range(2)]
    sizes = torch.tensor([len(step) for steps in epochs for step in steps])
    with torch.no_grad():
        evaluated = rt.setup_loader(_loader(urls, workers), evaluation=True)
        seen = [[int(i) for (batch,) in evaluated for i in batch]]
    return {
        "counts": [_counts(rt, steps) for steps in epochs],
        "steps": [len(steps) for steps in epochs],
        "evaluated": _counts(rt, seen),
        "mine": sorted(i for step in epochs[0] for i in step),
        "sizes": [part.tolist() for part in rt.all_gather(sizes)],
        "weights": [part.tolist() for part in rt.all_gather(torch.tensor(weights))],
    }


@pytest.mark.parametrize(("workers", "web_loader"), [(0, False), (2, False), (2, True)])
def test_a_webdataset_pipeline_trains_each_sample_once_an_epoch_on_two_processes(
    workers: int, web_loader: bool, tmp_path: Path
) -> None:
    urls = write_shards(tmp_path)
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=5)
    result = rt.launch(_epochs, urls, workers, web_loader)
    assert result is not None
    assert result["counts"] == [[1] * SAMPLES] * 2
    assert result["evaluated"] == [1] * SAMPLES
    # shards 0, 2 and 4 are the first process's: 60 samples, its part of every epoch
    assert result["mine"] == [*range(0, 30), *range(55, 75), *range(93, 103)]
    assert result["steps"][0] == result["steps"][1] >= 60 // (BATCH // 2)
    # each step's loss weight is the process's share of the step's samples (0: a stand-in),
    # so the mean of the two processes' losses is the step's mean over its samples
    for step, sizes in enumerate(zip(*result["sizes"], strict=True)):
        for size, weights in zip(sizes, result["weights"], strict=True):
            assert weights[step] == pytest.approx(size * 2 / sum(sizes))
    assert 0.0 in result["weights"][1]  # the shorter part (43 samples) ran out first


def _stopped_and_resumed(
    rt: paratrain.Runtime, urls: list[str], folder: str, stops: list[tuple[int, int]]
) -> Any:
    """Two epochs, stopped at each ``(epoch, step)`` of ``stops``, saved with rt.save and
    resumed in fresh objects; each epoch's steps on this process, and the weights."""
    path = Path(folder) / "resume.pt"
    model, optimizer, loader = _setup(rt, urls, 2, False)
    epochs: list[list[list[int]]] = [[], []]
    at = (0, 0)
    for stop in [*stops, (2, 0)]:
        while at < stop:
            steps = stop[1] - at[1] if at[0] == stop[0] else None
            epochs[at[0]] += _train(rt, model, optimizer, loader, steps)
            at = (at[0] + 1, 0) if steps is None else stop
        if stop == (2, 0):
            break
        rt.save(path, {"model": model, "optimizer": optimizer, "loader": loader})
        model, optimizer, loader = _setup(rt, urls, 2, False)
        rt.load(path, into={"model": model, "optimizer": optimizer, "loader": loader})
        assert loader.state_dict() == {"epoch": stop[0], "batch": stop[1]}
    return {"epochs": epochs, "weights": [p.detach().clone() for p in model.parameters()]}


def _uninterrupted(rt: paratrain.Runtime, urls: list[str]) -> Any:
    model, optimizer, loader = _setup(rt, urls, 2, False)
    epochs = [_train(rt, model, optimizer, loader, None) for _ in range(2)]
    return {"epochs": epochs, "weights": [p.detach().clone() for p in model.parameters()]}


def test_a_webdataset_pipeline_stopped_mid_epoch_resumes_with_exactly_the_batches_left(
    tmp_path: Path,
) -> None:
    urls = write_shards(tmp_path)
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=5)
    whole = rt.launch(_uninterrupted, urls)
    resumed = rt.launch(_stopped_and_resumed, urls, str(tmp_path), [(0, 3), (1, 2), (1, 5)])
    assert whole is not None and resumed is not None
    # the shuffle buffers draw a new order each epoch, and the same one on a resume
    assert whole["epochs"][0] != whole["epochs"][1]
    assert resumed["epochs"] == whole["epochs"]
    for a, b in zip(whole["weights"], resumed["weights"], strict=True):
        assert torch.equal(a, b)
