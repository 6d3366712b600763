"""A loop may take batches before it uses them: the same model all the same.

A training batch carries its own loss weight and whether it ends the epoch (its accumulation
group), and the step reads them when the batch is used. Loops that hold one batch in hand
(prefetch), ``list(loader)``, ``zip`` with a longer loader and ``itertools.islice`` train the
weights of the plain loop, on ``--strategy cpu`` and ``ddp`` on ``cpu,cpu``, with and
without accumulation, with an uneven last batch (100 samples, global batches of 31).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

pytestmark = pytest.mark.slow  # real processes, or several layers at work

SAMPLES, BATCH, EPOCHS = 100, 31, 2
#: batches of the first epoch that the "islice" loop (and its plain reference) trains on
SLICED = 2


def _data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, 5, generator=generator), torch.randn(samples, 1, generator=generator)
    )


def _prefetched(batches: Iterable[Any]) -> Iterator[Any]:
    """One batch always taken ahead of the one in use, as prefetching loops do."""
    iterator = iter(batches)
    held = next(iterator, None)
    for following in iterator:
        yield held
        held = following
    if held is not None:
        yield held


def _epoch(rt: paratrain.Runtime, loader: Any, other: Any, how: str, epoch: int) -> Iterable[Any]:
    if how == "prefetch":
        return _prefetched(loader)
    if how == "list":
        return list(loader)
    if how == "zip":  # a second training loader, longer, iterated alongside and never used
        return (pair for pair, _ in zip(loader, other, strict=False))
    if how in ("islice", "plain-sliced") and epoch == 0:
        return itertools.islice(loader, SLICED) if how == "islice" else loader
    return loader


def _train(rt: paratrain.Runtime, how: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = rt.setup_loader(DataLoader(_data(SAMPLES, 1), batch_size=BATCH, shuffle=True))
    other = rt.setup_loader(DataLoader(_data(3 * SAMPLES, 2), batch_size=BATCH, shuffle=True))
    for epoch in range(EPOCHS):
        for index, (x, y) in enumerate(_epoch(rt, loader, other, how, epoch)):
            if how == "plain-sliced" and epoch == 0 and index == SLICED:
                break
            with rt.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                rt.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _differences(rt: paratrain.Runtime) -> dict[str, float]:
    """Each loop's largest weight difference from the plain loop it stands for."""
    plain = _train(rt, "plain")
    differences = {}
    for how in ("prefetch", "list", "zip"):
        weights = _train(rt, how)
        differences[how] = max(
            (a - b).abs().max().item() for a, b in zip(weights, plain, strict=True)
        )
    sliced, reference = _train(rt, "islice"), _train(rt, "plain-sliced")
    differences["islice"] = max(
        (a - b).abs().max().item() for a, b in zip(sliced, reference, strict=True)
    )
    return differences


@pytest.mark.parametrize("accumulate", [1, 3])
def test_batches_taken_ahead_train_the_plain_loops_model_on_cpu(accumulate: int) -> None:
    """--strategy cpu."""
    rt = paratrain.Runtime("cpu", accumulate=accumulate, seed=0)
    differences = _differences(rt)
    assert all(d <= 1e-7 for d in differences.values()), differences


def _launched(rt: paratrain.Runtime) -> dict[str, float]:
    return _differences(rt)


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 3])
def test_batches_taken_ahead_train_the_plain_loops_model_under_ddp(accumulate: int) -> None:
    """--strategy ddp on cpu,cpu (two gloo processes): the last global batch of 7 splits
    4 + 3, so each process's loss weight differs from 1 there."""
    rt = paratrain.Runtime("ddp", devices="cpu,cpu", accumulate=accumulate, seed=0)
    differences = rt.launch(_launched)
    assert differences is not None
    assert all(d <= 1e-7 for d in differences.values()), differences
