"""Evaluation counts every sample exactly once, also where a process's part of the last
evaluation batch is empty (a last batch smaller than the number of processes).

The cuts are checked in-process for every rank of 2 to 4 simulated processes, on both ways
of making batches; then three real processes (gloo, fsdp, whose forward is a collective the
empty process still joins) evaluate a model over several such sizes in one launch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.data.paths import setup_data_path
from paratrain.training.loop import evaluate

pytestmark = pytest.mark.slow  # real processes, or several layers at work


CPU = torch.device("cpu")
#: (samples, evaluation batch): each leaves a last batch of 1 or 2 samples
SIZES = [(9, 4), (10, 4), (13, 6), (5, 2), (7, 3), (1, 4)]


def _cut(n: int, batch: int, world: int, data_path: str, shuffle: bool) -> list[list[int]]:
    """Each rank's evaluation batches of sample ids."""
    ids = TensorDataset(torch.arange(n))
    parts = []
    for rank in range(world):
        loader = setup_data_path(
            DataLoader(ids, batch_size=batch, shuffle=shuffle),
            device=CPU,
            rank=rank,
            world_size=world,
            seed=3,
            evaluation=True,
            sink=None,
            data_path=data_path,
        )
        batches = [b.tolist() for (b,) in loader]
        assert len(batches) == len(loader)  # len() counts the batches it yields
        assert all(batches)  # an empty part is skipped, not delivered empty
        parts.append([i for b in batches for i in b])
    return parts


@pytest.mark.parametrize("data_path", ["loader", "batched"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_sample_once_when_a_last_part_is_empty(world: int, data_path: str) -> None:
    """Simulated ranks of ``--devices cpu,cpu[,cpu[,cpu]]``."""
    for n, batch in SIZES:
        for shuffle in (False, True):
            parts = _cut(n, batch, world, data_path, shuffle)
            assert sorted(i for part in parts for i in part) == list(range(n)), (n, batch)
            if n % batch:  # the last batch's parts: near-equal, the empty ones at the end
                tails = [
                    len(part) - (n // batch) * len(range(r, batch, world))
                    for r, part in enumerate(parts)
                ]
                assert sorted(tails, reverse=True) == tails
                assert tails[0] - tails[-1] <= 1
                assert sum(tails) == n % batch


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(n)
    return torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, 3)


def _evaluate_sizes(rt: paratrain.Runtime) -> list[tuple[float, float | None, list[float]]]:
    """Loss, accuracy and how often each sample was delivered, per size, as rank 0 sees."""
    model = rt.setup(_model())
    results = []
    for n, batch in SIZES:
        x, y = _data(n)
        test = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
        loss, accuracy = evaluate(
            rt, model, rt.setup_loader(test, evaluation=True), nn.CrossEntropyLoss(), True
        )
        seen = torch.zeros(n)
        ids = DataLoader(TensorDataset(torch.arange(n)), batch_size=batch, shuffle=True)
        for (part,) in rt.setup_loader(ids, evaluation=True):
            seen[part] += 1
        results.append((loss, accuracy, rt.all_reduce(seen, "sum").tolist()))
    return results


def test_evaluation_counts_every_sample_once_in_real_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--strategy fsdp --devices cpu,cpu,cpu``: fsdp's forward is a collective, so a
    process whose part of the last batch is empty runs a forward that counts nothing; the
    others must not wait for it (a hang fails within the collective timeout) nor count it."""
    monkeypatch.setenv("PARATRAIN_COLLECTIVE_TIMEOUT", "60")
    rt = paratrain.Runtime(strategy="fsdp", devices="cpu,cpu,cpu")
    results: Any = rt.launch(_evaluate_sizes)
    assert results is not None
    model = _model()
    for (n, _), (loss, accuracy, seen) in zip(SIZES, results, strict=True):
        x, y = _data(n)
        with torch.no_grad():
            output = model(x)
        assert seen == [1.0] * n
        assert loss == pytest.approx(nn.functional.cross_entropy(output, y).item(), rel=1e-6)
        assert accuracy == (output.argmax(dim=1) == y).sum().item() / n
