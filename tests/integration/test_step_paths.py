"""Every way a step is taken runs the same stages (paratrain.runtime.step).

The compile check on ``rt.forward_backward`` under ``--oom auto`` and on the loop of
``paratrain train`` (which runs that way), and out-of-memory recovery in a user's own ddp
loop whose model runs out inside its forward on one rank only.

Devices: ``--strategy cpu`` in this process; ``ddp`` on ``cpu,cpu`` (two gloo processes).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.training.config import TrainConfig
from paratrain.training.loop import train
from paratrain.training.recipes import get_recipe

pytestmark = pytest.mark.slow  # real processes, or several layers at work


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.slow
def test_the_compile_check_runs_on_forward_backward_in_pieces(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--strategy cpu, --oom auto (the way `paratrain train` takes its steps): the first
    step's compiled gradients are checked, not left pending."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    rt = paratrain.Runtime(strategy="cpu", compile=True, oom="auto")
    net = _mlp()
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    rt.forward_backward(model, nn.functional.cross_entropy, x, torch.arange(8) % 2)
    optimizer.step()
    assert rt.describe()["compile_check"]["state"] == "agreed"
    assert "gradients agree with eager" in capsys.readouterr().err


@pytest.mark.slow
def test_paratrain_trains_loop_completes_the_compile_check(tmp_path: Path) -> None:
    """--strategy cpu, the loop of `paratrain train --recipe digits --compile`: config.json
    records the check's verdict (on torch 2.13's CPU inductor the digits CNN's convolutions
    get wrong gradients, so it falls back to eager), never "pending"."""
    rt = paratrain.Runtime("cpu", compile=True, oom="auto", seed=0)
    cfg = TrainConfig(recipe="digits", strategy="cpu", epochs=1, batch_size=32)
    cfg = dataclasses.replace(cfg.resolved(get_recipe), max_steps=2, progress=False)
    train(rt, cfg, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["runtime"]["compile_check"]["state"] in ("agreed", "fell back")


class _Hungry(nn.Module):
    """Runs out of memory inside its forward on rank 1 with more than 16 samples."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() == 1 and x.shape[0] > 16:
            raise torch.OutOfMemoryError("rank 1 holds at most 16 samples")
        return self.net(x)


def _user_loop(rt: paratrain.Runtime, split: int) -> list[torch.Tensor]:
    """A user's loop with rt.forward_backward; ``split``: pieces from the start."""
    rt.micro_batches.split = split
    torch.manual_seed(0)
    model = _Hungry()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(192, 6, generator=generator), torch.randint(0, 3, (192,)))
    for x, y in rt.setup_loader(DataLoader(data, batch_size=64)):
        rt.forward_backward(model, nn.functional.cross_entropy, x, y)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _recovered_and_reference(rt: paratrain.Runtime) -> float:
    recovered = _user_loop(rt, 1)
    assert rt.micro_batches.split == 2
    reference = _user_loop(rt, 2)
    return max((a - b).abs().max().item() for a, b in zip(recovered, reference, strict=True))


@pytest.mark.slow
def test_a_user_ddp_loop_recovers_from_running_out_in_the_forward(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """ddp on cpu,cpu: rank 1 alone runs out inside DDP's forward at the first step; every
    process drops the piece (DDP's reducer, prepared on rank 0 for a backward that never
    comes, is reset on both) and redoes it in halves: no collective mismatch, and the
    weights of a run in halves from the start."""
    rt = paratrain.Runtime("ddp", devices="cpu,cpu", oom="auto")
    difference = rt.launch(_recovered_and_reference)
    assert difference is not None and difference <= 1e-6
    err = capfd.readouterr().err
    assert err.count("out of memory on rank(s) 1 at step 1 with 32 samples per process") == 1
