"""torchdata's StatefulDataLoader through ``rt.setup_loader``: its own sampler classes read as
torch's (``shuffle=True`` is a shuffle, where it used to be refused under ddp with "build the
DataLoader with shuffle=True"), and it stays a StatefulDataLoader, so its ``state_dict()``
resumes an epoch where it stopped."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import paratrain

pytestmark = pytest.mark.slow  # real processes
stateful = pytest.importorskip("torchdata.stateful_dataloader")

SAMPLES, BATCH = 103, 10


def _loader(rt: paratrain.Runtime, workers: int) -> Any:
    data = TensorDataset(torch.arange(SAMPLES))
    made = stateful.StatefulDataLoader(data, batch_size=BATCH, shuffle=True, num_workers=workers)
    return rt.setup_loader(made)


def _epochs(rt: paratrain.Runtime, workers: int) -> dict[str, Any]:
    """Two epochs' samples on this process; then, mid-epoch: the state after 4 batches of
    epoch 1, and the samples a fresh loader yields from that state."""
    loader = _loader(rt, workers)
    assert isinstance(loader.loader, stateful.StatefulDataLoader)
    seen = [[int(i) for (batch,) in loader for i in batch] for _ in range(2)]
    loader.set_epoch(1)
    taken, state = [], None
    for index, (batch,) in enumerate(loader):
        taken += [int(i) for i in batch]
        if index == 3:
            state = loader.state_dict()
            break
    fresh = _loader(rt, workers)
    fresh.load_state_dict(state)
    rest = [int(i) for (batch,) in fresh for i in batch]
    return {"rank": rt.rank, "seen": seen, "taken": taken, "rest": rest}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_is_shuffled_once_per_epoch_and_resumes_mid_epoch(
    workers: int,
) -> None:
    """--strategy ddp --devices cpu,cpu (gloo), 103 numbered samples, batch 10, 0 and 2
    workers: each epoch shows every sample once across the processes (a new order each
    epoch); a state taken after 4 batches of an epoch gives a fresh loader exactly the
    samples that epoch had left."""
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0)
    results = rt.launch(_gathered, workers)
    assert results is not None
    for epoch in range(2):
        both = results[0]["seen"][epoch] + results[1]["seen"][epoch]
        assert sorted(both) == list(range(SAMPLES)), epoch
    assert results[0]["seen"][0] != results[0]["seen"][1]  # reshuffled
    for result in results:
        assert result["taken"] + result["rest"] == result["seen"][1]


def _gathered(rt: paratrain.Runtime, workers: int) -> list[dict[str, Any]]:
    """Both processes' results, on the main process (rt.launch returns its value)."""
    mine = _epochs(rt, workers)
    other = rt.broadcast_object(mine if rt.rank == 1 else None, src=1)
    return [mine, other]
