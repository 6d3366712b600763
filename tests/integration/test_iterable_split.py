"""An IterableDataset through ``rt.setup_loader`` with DataLoader workers (real worker
processes) and on two real processes: each sample once, in evaluation and in training,
where each worker used to yield the whole stream (206 of 103 samples counted)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import paratrain

pytestmark = pytest.mark.slow  # worker processes, and real processes

SAMPLES = 103


class Stream(IterableDataset):  # type: ignore[type-arg]
    """Samples ``(x, i)`` for i in 0..n-1, the whole stream in every copy."""

    def __init__(self, n: int = SAMPLES) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.n):
            yield torch.tensor([float(i)]), torch.tensor(i)


class SelfSplitStream(Stream):
    """A stream that gives each worker its share itself, and says so."""

    splits_itself = True

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        for x, i in super().__iter__():
            if int(i) // 10 % workers == worker:  # blocks of 10, not the item rule
                yield x, i


def _seen(rt: paratrain.Runtime, loader: DataLoader) -> list[float]:  # type: ignore[type-arg]
    """How often each sample came, summed over the processes."""
    seen = torch.zeros(SAMPLES)
    with torch.no_grad():
        for _, i in rt.setup_loader(loader, evaluation=True):
            seen[i] += 1
    return rt.all_reduce(seen).tolist()


def test_workers_split_an_iterable_set_each_sample_once() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0, accumulate=3)
    assert _seen(rt, DataLoader(Stream(), batch_size=10, num_workers=2)) == [1.0] * SAMPLES
    assert _seen(rt, DataLoader(SelfSplitStream(), batch_size=10, num_workers=2)) == (
        [1.0] * SAMPLES
    )
    # training: every sample once an epoch, in global batches of 10 whatever the workers
    # (11 of them); the epoch's end is known without a length, so the last, unfinished group
    # of micro-batches is applied there
    model = nn.Linear(1, 1)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    loader = rt.setup_loader(DataLoader(Stream(), batch_size=10, num_workers=2))
    for epoch in range(2):
        seen = torch.zeros(SAMPLES)
        batches = 0
        for x, i in loader:
            with rt.accumulate(model):
                rt.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            seen[i] += 1
            batches += 1
        assert seen.tolist() == [1.0] * SAMPLES
        assert batches == 11
        assert rt.state.step == 4 * (epoch + 1)  # groups of 3, 3, 3, 2: none carried over


def _evaluate_stream(rt: paratrain.Runtime) -> list[float]:
    return _seen(rt, DataLoader(Stream(), batch_size=10, num_workers=2))


def test_two_processes_with_two_workers_each_see_every_sample_once() -> None:
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu")
    assert rt.launch(_evaluate_stream) == [1.0] * SAMPLES
