"""``rt.save`` inside an accumulation group (:mod:`paratrain.checkpoints.state.group`): the
group's gradients and position are written only then, and ``rt.load`` puts them back; a
run with another number of processes or another ``accumulate`` is told what it gets.

One process (the plain :class:`Collective`); several processes' records are made by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import paratrain
from paratrain.checkpoints.state.group import GroupPosition, capture_group, restore_group
from paratrain.checkpoints.state.user import RESERVED
from paratrain.distributed.collective import Collective


def _model_with_gradients() -> nn.Module:
    model = nn.Linear(2, 1)
    model(torch.ones(3, 2)).sum().backward()
    return model


def test_the_record_holds_each_processs_gradients_by_plain_name() -> None:
    model = _model_with_gradients()
    record = capture_group(Collective(), {"model": model, "epoch": 1}, GroupPosition(1, 2))
    assert record is not None
    assert (record["micro_steps"], record["accumulate"], record["sync_gradients"]) == (1, 2, False)
    [mine] = record["gradients"]
    assert set(mine) == {"model"} and set(mine["model"]) == {"weight", "bias"}
    assert torch.equal(mine["model"]["weight"], model.weight.grad)
    assert mine["model"]["weight"] is not model.weight.grad  # a copy: training goes on


def test_another_number_of_processes_continues_with_their_mean(
    capsys: pytest.CaptureFixture[str],
) -> None:
    record = {
        "micro_steps": 1,
        "accumulate": 2,
        "sync_gradients": False,
        "gradients": [
            {"model": {"weight": torch.tensor([[1.0, 2.0]]), "bias": torch.tensor([1.0])}},
            {"model": {"weight": torch.tensor([[3.0, 4.0]]), "bias": torch.tensor([3.0])}},
        ],
    }
    model = nn.Linear(2, 1)
    at = restore_group(Collective(), record, {"model": model}, accumulate=2)
    assert at == GroupPosition(1, 2, False)
    assert model.weight.grad is not None and model.bias.grad is not None
    assert torch.equal(model.weight.grad, torch.tensor([[2.0, 3.0]]))
    assert torch.equal(model.bias.grad, torch.tensor([2.0]))
    assert "saved after 1 of the 2 micro-batches of a group by 2 process(es)" in (
        capsys.readouterr().err
    )


def test_another_accumulate_or_no_model_to_load_into_starts_a_new_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = _model_with_gradients()
    record = capture_group(Collective(), {"model": model}, GroupPosition(1, 2))
    assert record is not None
    fresh = nn.Linear(2, 1)
    assert restore_group(Collective(), record, {"model": fresh}, accumulate=4) is None
    assert "accumulate=2), this run has accumulate=4" in capsys.readouterr().err
    assert restore_group(Collective(), record, {}, accumulate=2) is None
    assert "pass 'model' in rt.load(path, into=...)" in capsys.readouterr().err
    assert fresh.weight.grad is None


def _micro_batch(rt: paratrain.Runtime, model: nn.Module) -> None:
    rt.backward(model(torch.ones(3, 2)).pow(2).mean())


def test_only_a_save_inside_a_group_holds_gradients(tmp_path: Path) -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0, accumulate=2)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    parts = {"model": model, "optimizer": optimizer}
    _micro_batch(rt, model)
    optimizer.step()
    rt.save(tmp_path / "inside.pt", parts)
    saved = model.weight.grad.clone()
    _micro_batch(rt, model)
    optimizer.step()
    optimizer.zero_grad()
    rt.save(tmp_path / "between.pt", parts)
    assert "group" not in torch.load(tmp_path / "between.pt", weights_only=True)[RESERVED]
    assert "group" in torch.load(tmp_path / "inside.pt", weights_only=True)[RESERVED]

    resumed = paratrain.Runtime(strategy="cpu", seed=0, accumulate=2)
    again = nn.Linear(2, 1)
    again_optimizer = torch.optim.SGD(again.parameters(), lr=0.1)
    again, again_optimizer = resumed.setup(again, again_optimizer)
    resumed.load(tmp_path / "inside.pt", {"model": again, "optimizer": again_optimizer})
    assert (resumed.state.micro_steps, resumed.sync_gradients) == (1, False)
    assert again.weight.grad is not None and torch.equal(again.weight.grad, saved)
