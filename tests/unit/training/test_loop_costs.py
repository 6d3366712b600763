"""The training loop's own costs: checkpoints written in the background, timings reported,
evaluation in larger batches that still count every sample once."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import paratrain
from paratrain.checkpoints.state import (
    Checkpointer,
    Position,
    ProcessLayout,
    TrainingParts,
    snapshot,
)
from paratrain.checkpoints.state.background import BackgroundWriter, detached_copy
from paratrain.cli.main import main
from paratrain.training import recipes
from paratrain.training.config import TrainConfig
from paratrain.utils.errors import UserError


def test_background_jobs_run_one_at_a_time_in_order() -> None:
    writer, log, gate = BackgroundWriter(), [], threading.Event()
    writer.submit(lambda: (gate.wait(), log.append(1)))
    assert log == []  # still blocked
    gate.set()
    writer.submit(lambda: log.append(2))  # waits for the first job before starting
    assert log[0] == 1
    writer.wait()
    assert log == [1, 2]


def test_background_error_is_raised_at_the_next_submit_or_wait() -> None:
    writer = BackgroundWriter()

    def fail() -> None:
        raise OSError("disk full")

    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.submit(lambda: None)
    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    writer.wait()  # reported once


def test_detached_copy_shares_nothing_with_the_original() -> None:
    state = {"state": {0: {"momentum_buffer": torch.ones(3)}}, "param_groups": [{"lr": [0.1]}]}
    copy = detached_copy(state)
    state["state"][0]["momentum_buffer"].add_(1)
    state["param_groups"][0]["lr"].append(0.2)
    assert torch.equal(copy["state"][0]["momentum_buffer"], torch.ones(3))
    assert copy["param_groups"] == [{"lr": [0.1]}]


def _checkpointer(run: Path, model: nn.Module) -> Checkpointer:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    cfg = TrainConfig(recipe="linear").resolved(recipes.get_recipe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    layout = ProcessLayout(rt.strategy.collective, rt.strategy.devices, rt.strategy.name)
    return Checkpointer(layout, run, cfg, TrainingParts(model, optimizer), 10, Position())


def test_checkpoint_holds_the_state_of_when_it_was_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Linear(10, 1)
    saver = _checkpointer(tmp_path, model)
    optimizer = saver.parts.optimizer
    model.weight.grad, model.bias.grad = torch.ones(1, 10), torch.ones(1)
    optimizer.step()  # a momentum buffer, changed in place by the next step
    with torch.no_grad():
        model.weight.fill_(1.0)
    momentum = optimizer.state[model.weight]["momentum_buffer"].clone()
    # the write waits until training went on: a state shared, not copied, would show
    gate, write = threading.Event(), snapshot.write_checkpoint
    monkeypatch.setattr(snapshot, "write_checkpoint", lambda *a: (gate.wait(60), write(*a))[1])
    path = saver.save(0, 3, 3)
    with torch.no_grad():
        model.weight.fill_(2.0)
    optimizer.step()
    gate.set()
    saver.wait()
    assert path is not None and torch.equal(
        load_file(str(path / "model.safetensors"))["weight"], torch.ones(1, 10)
    )
    saved = torch.load(path / "optimizer.pt", weights_only=True)["state"][0]
    assert torch.equal(saved["momentum_buffer"], momentum)


def test_a_failed_background_write_is_raised_by_the_next_save(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").write_text("a file where the folder should be")
    saver = _checkpointer(tmp_path, nn.Linear(10, 1))
    saver.save(0, 1, 1)  # returns at once; the write fails in the background
    with pytest.raises(UserError, match=r"cannot write .*step-000001: File exists"):
        saver.save(0, 2, 2)


@pytest.mark.slow
def test_timings_and_summary_report_the_loop_costs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--no-progress", "--out", str(out), "--recipe", "linear", "--epochs", "3"]
    assert main([*argv, "--strategy", "cpu", "--batch-size", "64", "--save-every", "5"]) == 0
    line = capsys.readouterr().out
    assert "of the time" in line and "evaluation" in line and "checkpoints" in line
    records = [json.loads(text) for text in (out / "timings.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1, 2]
    for record in records:
        assert 0 < record["eval_seconds"] < record["seconds"]
        assert 0 < record["checkpoint_seconds"] < record["seconds"]
    times = json.loads((out / "config.json").read_text())["summary"]["times"]
    assert times["eval_seconds"] == pytest.approx(sum(r["eval_seconds"] for r in records))
    assert times["compiled_graphs"] == 0 and times["steady_samples_per_second"] > 0
    # The figures that must be reproducible stay apart from the timings.
    metrics = (out / "metrics.jsonl").read_text()
    assert "seconds" not in metrics


def test_evaluation_in_large_batches_counts_every_sample_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # 200 test samples in evaluation batches of 4 x 30 = 120: an uneven last batch
    argv = ["--recipe", "linear", "--epochs", "1", "--batch-size", "30"]
    assert main(["train", "--no-progress", "--out", str(out), "--strategy", "cpu", *argv]) == 0
    capsys.readouterr()
    weights = load_file(str(out / "model.safetensors"))
    model = nn.Linear(10, 1)
    model.load_state_dict(weights)
    _, test_set = recipes.get_recipe("linear").build_data(TrainConfig(recipe="linear"))
    x, y = test_set.tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        expected = nn.functional.mse_loss(model(x), y).item()
    lines = (out / "metrics.jsonl").read_text().splitlines()
    evaluated = [json.loads(line) for line in lines if '"eval"' in line]
    assert evaluated[-1]["loss"] == pytest.approx(expected, rel=1e-6)
