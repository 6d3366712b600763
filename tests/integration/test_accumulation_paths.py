"""Accumulation trains the model of the plain run on the paths users take around it.

* An LR scheduler handed to ``rt.setup`` and stepped after every ``optimizer.step()``
  call (the idiom of most scripts) advances once per optimizer step that applied
  gradients: ``accumulate=2`` with micro-batch 16 trains the weights of batch 32 without
  accumulation, on one process and on ddp over two.
* ``rt.save`` in the middle of an accumulation group and ``rt.load`` in a fresh process
  continue the group: the resumed run ends bit-identical to the uninterrupted one. Under
  fsdp such a save is refused with one line.
* ``paratrain train`` hands its recipe's scheduler to ``rt.setup``: a step skipped for a
  non-finite loss does not advance it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import main_in_process
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.checkpoints.state import list_checkpoints
from paratrain.checkpoints.weights import unwrap_model
from paratrain.training import recipes
from paratrain.utils.errors import UserError

pytestmark = pytest.mark.slow  # real processes, or several layers at work

DDP2 = {"strategy": "ddp", "devices": "cpu,cpu"}
#: the largest difference allowed between the accumulated and the plain run: the mean of
#: a batch of 32 and the sum of two halves of 16 round differently
ROUNDING = 1e-7


def _data(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(samples, 6, generator=generator), torch.randn(samples, 2, generator=generator)
    )


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in unwrap_model(model).state_dict().items()}


# -- a scheduler under accumulation --------------------------------------------------------
def _schedule(kind: str, optimizer: torch.optim.Optimizer) -> Any:
    if kind == "one-cycle":  # raises if stepped more often than its 4 steps
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=4)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)


def _scheduled(rt: paratrain.Runtime, batch_size: int, kind: str) -> dict[str, Any]:
    """One epoch of 128 samples, ``scheduler.step()`` after every ``optimizer.step()``."""
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = _schedule(kind, optimizer)
    model, optimizer, scheduler = rt.setup(model, optimizer, scheduler)
    loader = rt.setup_loader(DataLoader(_data(128), batch_size=batch_size, shuffle=True))
    for x, y in loader:
        with rt.accumulate(model):
            rt.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {
        "weights": _weights(model),
        "lr": optimizer.param_groups[0]["lr"],
        "schedule": scheduler.state_dict()["last_epoch"],
    }


def _same_within(plain: dict[str, Any], other: dict[str, Any], tolerance: float) -> float:
    assert (other["lr"], other["schedule"]) == (plain["lr"], plain["schedule"])
    diff = max(
        (plain["weights"][k] - other["weights"][k]).abs().max().item() for k in plain["weights"]
    )
    assert diff <= tolerance, diff
    return diff


def test_a_scheduler_handed_to_setup_follows_the_applied_steps_on_one_process() -> None:
    plain = _scheduled(paratrain.Runtime(strategy="cpu", seed=0), 32, "lambda")
    accumulated = _scheduled(paratrain.Runtime(strategy="cpu", seed=0, accumulate=2), 16, "lambda")
    assert plain["schedule"] == 4  # four optimizer steps, four scheduler steps
    diff = _same_within(plain, accumulated, ROUNDING)
    print(f"\naccumulate 2 x 16 vs batch 32, LambdaLR, cpu: max abs diff {diff:.3g}")


def test_a_scheduler_handed_to_setup_follows_the_applied_steps_under_ddp() -> None:
    plain = _scheduled(paratrain.Runtime(strategy="cpu", seed=0), 32, "one-cycle")
    accumulated = paratrain.Runtime(**DDP2, seed=0, accumulate=2).launch(
        _scheduled, 16, "one-cycle"
    )
    assert accumulated is not None
    diff = _same_within(plain, accumulated, ROUNDING)
    print(f"\naccumulate 2 x 16 on ddp x2 vs batch 32 on cpu, OneCycleLR: max abs diff {diff:.3g}")


# -- a checkpoint in the middle of an accumulation group ------------------------------------
SAVE_AT = 3  # micro-batches: the second group's first one (accumulate=2)


def _resumable(rt: paratrain.Runtime, path: Path, stop_at: int | None) -> dict[str, Any] | None:
    """The docs' rt.save/rt.load loop under accumulate=2: saves after micro-batch
    ``SAVE_AT``, returns at ``stop_at`` (a crash); resumes from ``path`` if it exists."""
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.setup_loader(DataLoader(_data(64), batch_size=8, shuffle=True))
    parts = {"model": model, "optimizer": optimizer}
    start, batch, micro = 0, 0, 0
    if path.exists():
        state = rt.load(path, parts)
        start, batch, micro = state["epoch"], state["batch"], state["micro"]
    for epoch in range(start, 2):
        loader.set_epoch(epoch, start_batch=batch)
        for x, y in loader:
            with rt.accumulate(model):
                rt.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            batch, micro = batch + 1, micro + 1
            if micro == SAVE_AT:
                assert rt.state.micro_steps == 1  # inside a group
                rt.save(path, {**parts, "epoch": epoch, "batch": batch, "micro": micro})
            if micro == stop_at:
                return None
        batch = 0
    return _weights(model)


def _uninterrupted_and_stopped(rt: paratrain.Runtime, folder: Path) -> dict[str, Any] | None:
    reference = _resumable(rt, folder / "reference.pt", None)
    _resumable(rt, folder / "stopped.pt", SAVE_AT + 1)
    return reference


def test_a_checkpoint_inside_a_group_resumes_bit_identical_on_one_process(tmp_path: Path) -> None:
    def runtime() -> paratrain.Runtime:
        return paratrain.Runtime(strategy="cpu", seed=0, accumulate=2)

    reference = _resumable(runtime(), tmp_path / "reference.pt", None)
    assert _resumable(runtime(), tmp_path / "stopped.pt", SAVE_AT + 1) is None
    resumed = _resumable(runtime(), tmp_path / "stopped.pt", None)
    assert reference is not None and resumed is not None
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


def test_a_checkpoint_inside_a_group_resumes_bit_identical_under_ddp(tmp_path: Path) -> None:
    rt = paratrain.Runtime(**DDP2, seed=0, accumulate=2)
    reference = rt.launch(_uninterrupted_and_stopped, tmp_path)
    # a fresh pair of processes: only the file carries the group over
    resumed = paratrain.Runtime(**DDP2, seed=0, accumulate=2).launch(
        _resumable, tmp_path / "stopped.pt", None
    )
    assert reference is not None and resumed is not None
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


def test_a_checkpoint_inside_a_group_is_refused_under_fsdp(tmp_path: Path) -> None:
    rt = paratrain.Runtime(strategy="fsdp", devices="cpu,cpu", seed=0, accumulate=2)
    with pytest.raises(UserError, match=r"'model' is sharded \(fsdp\) and the save comes after 1"):
        rt.launch(_resumable, tmp_path / "fsdp.pt", SAVE_AT + 1)


# -- paratrain train: the recipe's scheduler goes through rt.setup ---------------------------
def _regression_data(cfg: Any) -> tuple[TensorDataset, TensorDataset]:
    return _data(96), _data(32)


@pytest.fixture
def scheduled_recipe(monkeypatch: pytest.MonkeyPatch) -> str:
    """A recipe whose StepLR halves the learning rate at every optimizer step."""
    recipe = recipes.Recipe(
        name="test-scheduled",
        description="test only",
        epochs=2,  # three optimizer steps each
        batch_size=16,
        lr=0.05,
        build_model=lambda cfg: nn.Linear(6, 2),
        build_data=_regression_data,
        build_optimizer=lambda params, cfg: torch.optim.SGD(params, lr=0.05),
        build_loss=nn.MSELoss,
        classification=False,
        build_scheduler=lambda optimizer, cfg: torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5),
    )
    monkeypatch.setitem(recipes._RECIPES, recipe.name, recipe)
    return recipe.name


def test_paratrain_trains_scheduler_skips_a_step_skipped_for_a_non_finite_loss(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    scheduled_recipe: str,
) -> None:
    """Under --accumulate 2, both micro-batches of step 3 have a NaN loss: --skip-nonfinite
    skips them, that optimizer step applies nothing, and the scheduler stays where it was."""
    monkeypatch.setenv("PARATRAIN_TEST_FAULT", "nan:0:3")
    code, _, err = main_in_process(
        capsys, "train", "--no-progress", "--strategy", "cpu", "--recipe", scheduled_recipe,
        "--accumulate", "2", "--skip-nonfinite", "--max-steps", "5", "--out", tmp_path / "run",
    )  # fmt: skip
    assert code == 0, err
    assert "at step 3; every rank skipped it" in err
    checkpoint = list_checkpoints(tmp_path / "run")[-1]
    scheduler = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    assert scheduler["last_epoch"] == 4  # five optimizer steps, one of them skipped
