"""Checkpoints and exact resume, in process: generator states, the checkpoint directory,
``rt.save``/``rt.load``, and ``paratrain train --resume`` stopped at various steps."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cpu_data_parallel
from helpers.cli import main_in_process
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.checkpoints.files.readers import read_torch
from paratrain.checkpoints.state import (
    CHECKPOINTS,
    Checkpointer,
    Position,
    ProcessLayout,
    TrainingParts,
    capture_rng,
    list_checkpoints,
    load_checkpoint,
    manifest,
    restore_rng,
)
from paratrain.checkpoints.state.store import latest_checkpoint, write_checkpoint
from paratrain.training import recipes
from paratrain.training.config import TrainConfig
from paratrain.utils.errors import UserError

RECIPE = "test-dropout"
CPU = ("--strategy", "cpu")  # left to auto, a machine with GPUs would train there


def _draws() -> tuple[float, float, float, float, torch.Tensor]:
    """One draw of each generator; the gaussians use the one each generator has cached."""
    python = (random.random(), random.gauss(0, 1))
    return *python, float(np.random.rand()), float(np.random.randn()), torch.rand(3)


def test_generator_states_come_back_exactly() -> None:
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's generator...
    np.random.randn()  # ...and in NumPy's
    state = capture_rng([torch.device("cpu")])
    first = _draws()
    _draws()
    restore_rng(state, [torch.device("cpu")])
    again = _draws()
    assert first[:4] == again[:4] and torch.equal(first[4], again[4])


def test_generator_state_survives_a_weights_only_file(tmp_path: Path) -> None:
    torch.save(capture_rng(), tmp_path / "rng.pt")
    expected = _draws()
    restore_rng(read_torch(tmp_path / "rng.pt"))
    got = _draws()
    assert expected[:4] == got[:4] and torch.equal(expected[4], got[4])


def _write(run: Path, step: int, keep: int = 3) -> Path:
    files = {"state.json": lambda tmp: tmp.write_text(json.dumps({"step": step}))}
    return write_checkpoint(run, step, files, keep)


def test_checkpoint_directory_is_listed_pruned_and_ignores_leftovers(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        _write(tmp_path, step, keep=2)
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000015", "step-000020"]
    leftover = root / ".step-000025.tmp"  # what a crash during a save leaves
    leftover.mkdir()
    (leftover / "state.json").write_text("{}")
    (root / "step-000030").mkdir()  # not complete: no state.json
    assert latest_checkpoint(tmp_path) == root / "step-000020"
    _write(tmp_path, 25, keep=2)
    assert not leftover.exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000020", "step-000025"]
    _write(tmp_path, 25, keep=2)  # the same step again replaces it
    assert sorted(p.name for p in root.iterdir()) == ["step-000020", "step-000025", "step-000030"]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _dataset(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)
    )


def _own_loop(path: Path, stop_after: int | None, resume: bool) -> dict[str, torch.Tensor]:
    """A user's loop with dropout and a scheduler; saves every 3 batches."""
    rt = paratrain.Runtime(strategy="cpu", seed=5)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    loader = rt.setup_loader(
        DataLoader(_dataset(70), batch_size=8, shuffle=True, generator=torch.Generator())
    )
    start_epoch, start_batch, done = 0, 0, 0
    if resume:
        parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        state = rt.load(path, parts)
        start_epoch, start_batch, done = state["epoch"], state["batch"], state["done"]
    for epoch in range(start_epoch, 3):
        first = start_batch if epoch == start_epoch else 0
        loader.set_epoch(epoch, first)
        for batch, (x, y) in enumerate(loader, start=first + 1):
            optimizer.zero_grad()
            rt.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            scheduler.step()
            done += 1
            if batch % 3 == 0:
                parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
                rt.save(path, {**parts, "epoch": epoch, "batch": batch, "done": done})
            if done == stop_after:
                return {}
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_rt_save_and_load_resume_a_users_loop_exactly(tmp_path: Path) -> None:
    reference = _own_loop(tmp_path / "a.pt", None, resume=False)
    assert _own_loop(tmp_path / "b.pt", stop_after=13, resume=False) == {}
    resumed = _own_loop(tmp_path / "b.pt", None, resume=True)
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)
    # Without the generator states the dropout masks differ: the test can fail.
    state = torch.load(tmp_path / "b.pt", weights_only=True)
    assert set(state) >= {"model", "optimizer", "scheduler", "epoch", "__paratrain__"}
    assert "body.0.weight" in state["model"]


def test_rt_save_plain_names_and_clear_errors(tmp_path: Path) -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    wrapped = cpu_data_parallel(nn.Linear(2, 2))
    rt.save(tmp_path / "sub" / "s.pt", {"net": wrapped, "note": "hi", "t": torch.ones(2)})
    assert not [p for p in (tmp_path / "sub").iterdir() if p.name != "s.pt"]  # no temp file
    fresh = nn.Linear(2, 2)
    state = rt.load(tmp_path / "sub" / "s.pt", {"net": fresh, "t": torch.zeros(2)})
    assert set(state["net"]) == {"weight", "bias"}
    assert torch.equal(fresh.weight, wrapped.module.weight) and state["note"] == "hi"
    with pytest.raises(UserError, match="holds no 'opt'; it holds 'net', 'note', 't'"):
        rt.load(tmp_path / "sub" / "s.pt", {"opt": torch.optim.SGD(fresh.parameters(), lr=1)})
    with pytest.raises(UserError, match="is a object"):
        rt.save(tmp_path / "x.pt", {"bad": object()})
    torch.save({"a": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(UserError, match=r"was not written by rt\.save"):
        rt.load(tmp_path / "other.pt")


def _save_and_load_in_each_process(rt: paratrain.Runtime, path: str) -> list[list[float]]:
    model = nn.Linear(3, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    torch.manual_seed(100 + rt.rank)  # every process its own generator state
    rt.save(path, {"model": model, "optimizer": optimizer, "step": 7})
    expected = torch.rand(2)
    torch.manual_seed(0)
    fresh = nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    state = rt.load(path, {"model": fresh, "optimizer": fresh_optimizer})
    got = torch.rand(2)
    same = torch.equal(fresh.weight, model.module.weight)
    lr = fresh_optimizer.param_groups[0]["lr"]
    mine = torch.tensor([*expected, *got, float(same), float(state["step"]), lr])
    mine = torch.cat([mine, _checkpoint_in_each_process(rt, model, optimizer, Path(path))])
    return [t.tolist() for t in rt.all_gather(mine)]


def _checkpoint_in_each_process(
    rt: paratrain.Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path
) -> torch.Tensor:
    """The training loop's checkpoint: each process's generators and running loss come back
    to that process. Returns draws after the save and after the load, the loss sum, samples
    and step."""
    cfg = TrainConfig(recipe="linear", strategy="ddp", devices="cpu,cpu")
    cfg = cfg.resolved(recipes.get_recipe)
    layout = ProcessLayout(rt.strategy.collective, rt.strategy.devices, rt.strategy.name)
    run = path.parent / "run"
    parts = TrainingParts(model, optimizer)
    saver = Checkpointer(layout, run, cfg, parts, 10, Position(), background=False)
    saver.last_metrics = {"train_loss": 0.25}
    torch.manual_seed(200 + rt.rank)
    saver.save(0, 4, 4, loss_sum=float(rt.rank + 1), samples=10 + rt.rank)
    expected = torch.rand(2)
    torch.manual_seed(0)
    fresh = nn.Linear(3, 2)
    parts = TrainingParts(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    at = load_checkpoint(layout, run / CHECKPOINTS / "step-000004", parts, 10)
    return torch.tensor([*expected, *torch.rand(2), at.loss_sum, at.samples, at.step])


@pytest.mark.slow
def test_rt_save_and_load_with_two_processes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0)
    result = rt.launch(_save_and_load_in_each_process, str(tmp_path / "state.pt"))
    assert result is not None
    (r0, r1) = result
    assert r0[:2] != r1[:2]  # different generator states...
    assert r0[:2] == r0[2:4] and r1[:2] == r1[2:4]  # ...each restored in its own process
    assert r0[4:7] == r1[4:7] == [1.0, 7.0, 0.5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "state.pt"]
    # the loop's checkpoint: rng-rank{R}.pt of each process restored in that process
    assert r0[7:9] != r1[7:9] and r0[7:9] == r0[9:11] and r1[7:9] == r1[9:11]
    assert r0[11:] == [1.0, 10.0, 4.0] and r1[11:] == [2.0, 11.0, 4.0]
    # that checkpoint in one process: the epoch's running loss of both goes to rank 0
    one = paratrain.Runtime(strategy="cpu", seed=0)
    layout = ProcessLayout(one.strategy.collective, one.strategy.devices, one.strategy.name)
    checkpoint = tmp_path / "run" / CHECKPOINTS / "step-000004"
    fresh = nn.Linear(3, 2)
    parts = TrainingParts(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    with pytest.raises(UserError, match="10 batches per epoch, this run has 9: the data set"):
        load_checkpoint(layout, checkpoint, parts, 9)
    capsys.readouterr()
    at = load_checkpoint(layout, checkpoint, parts, 10)
    assert "saved by 2 process(es), this run has 1" in capsys.readouterr().err
    assert (at.loss_sum, at.samples, at.step) == (3.0, 21, 4)
    assert at.last_metrics == {"train_loss": 0.25}  # a run resumed at its end still reports it
    with (checkpoint / "optimizer.pt").open("ab") as file:
        file.write(b"x")  # damaged after the CLI checked it, or never checked (a library call)
    with pytest.raises(UserError, match=r"optimizer\.pt has \d+ bytes"):
        load_checkpoint(layout, checkpoint, parts, 10)


# -- paratrain train --resume ----------------------------------------------------------------
def _dropout_data(cfg: TrainConfig) -> recipes.Datasets:
    return _dataset(200), _dataset(40)


def _step_lr(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> object:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)


@pytest.fixture
def dropout_recipe(monkeypatch: pytest.MonkeyPatch) -> str:
    """A recipe that draws random numbers while training (dropout) and has a scheduler."""
    recipe = recipes.Recipe(
        name=RECIPE,
        description="test only",
        epochs=3,
        batch_size=16,
        lr=0.05,
        build_model=lambda cfg: _Net(),
        build_data=_dropout_data,
        build_optimizer=lambda params, cfg: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        build_loss=nn.CrossEntropyLoss,
        build_scheduler=_step_lr,
    )
    monkeypatch.setitem(recipes._RECIPES, RECIPE, recipe)
    return RECIPE


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code, _, err = main_in_process(capsys, "train", "--no-progress", *argv)
    return code, err


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize(
    "stop, options",
    [
        ("6", ()),  # mid-epoch, right after a --save-every checkpoint
        ("13", ()),  # at the end of the first epoch (13 batches)
        ("17", ("--accumulate", "2")),  # mid-epoch of the third epoch, 7 steps per epoch
    ],
)
@pytest.mark.slow
def test_run_stopped_at_a_step_resumes_bit_identical(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    dropout_recipe: str,
    stop: str,
    options: tuple[str, ...],
) -> None:
    common = (*CPU, "--recipe", dropout_recipe, "--save-every", "3", "--seed", "2", *options)
    assert _train(capsys, "--out", str(tmp_path / "ref"), *common)[0] == 0
    assert _train(capsys, "--out", str(tmp_path / "run"), *common, "--max-steps", stop)[0] == 0
    assert not _same_weights(tmp_path / "ref", tmp_path / "run")
    assert _train(capsys, "--resume", str(tmp_path / "run"), "--max-steps", "999")[0] == 0
    assert _same_weights(tmp_path / "ref", tmp_path / "run")
    ref_lines = (tmp_path / "ref" / "metrics.jsonl").read_text()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ref_lines  # nothing twice


@pytest.mark.slow
def test_resume_without_generator_states_is_not_exact(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, dropout_recipe: str
) -> None:
    """The dropout recipe really needs the generator states: the exactness tests can fail."""
    common = (*CPU, "--recipe", dropout_recipe, "--save-every", "3")
    assert _train(capsys, "--out", str(tmp_path / "ref"), *common)[0] == 0
    assert _train(capsys, "--out", str(tmp_path / "run"), *common, "--max-steps", "6")[0] == 0
    torch.manual_seed(1234)  # another state than the one saved
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000006"
    torch.save(capture_rng(), checkpoint / "rng-rank0.pt")
    sealed = manifest.build(checkpoint, 6, manifest.read(checkpoint)["files"])  # type: ignore[index]
    (checkpoint / manifest.MANIFEST).write_text(json.dumps(sealed))  # a change made on purpose
    assert _train(capsys, "--resume", str(tmp_path / "run"), "--max-steps", "999")[0] == 0
    assert not _same_weights(tmp_path / "ref", tmp_path / "run")


@pytest.mark.slow
def test_resume_extends_a_finished_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    common = (*CPU, "--recipe", "linear", "--batch-size", "100")
    assert _train(capsys, "--out", str(tmp_path / "ref"), *common, "--epochs", "3")[0] == 0
    assert _train(capsys, "--out", str(tmp_path / "run"), *common, "--epochs", "2")[0] == 0
    code, err = _train(capsys, "--resume", str(tmp_path / "run"))
    assert code == 2 and "the run is finished (20 steps, 2 epoch(s))" in err
    assert _train(capsys, "--resume", str(tmp_path / "run"), "--epochs", "3")[0] == 0
    assert _same_weights(tmp_path / "ref", tmp_path / "run")
    state = json.loads(
        (tmp_path / "run" / "checkpoints" / "step-000030" / "state.json").read_text()
    )
    assert (state["epoch"], state["batch"], state["step"], state["world_size"]) == (3, 0, 30, 1)
    assert state["strategy"] == "cpu" and state["recipe"] == "linear"


def test_resume_refuses_conflicting_options_and_bad_paths(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    common = (*CPU, "--recipe", "linear", "--batch-size", "100", "--save-every", "2")
    assert _train(capsys, "--out", str(run), *common, "--max-steps", "5")[0] == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, err = _train(
        capsys, "--resume", str(run), "--batch-size", "50", "--seed", "0", "--lr", "1"
    )
    assert code == 2
    assert "--batch-size 50 (the run: 100); --lr 1.0 (the run: 0.01)" in err
    assert "--seed" not in err  # the same value as the run's is no conflict
    code, err = _train(capsys, "--resume", str(run), "--overwrite")
    assert code == 2 and "drop one" in err
    code, err = _train(capsys, "--resume", str(run), "--max-steps", "3")
    assert code == 2 and "is at step 5; pass --max-steps 5 or more, not 3" in err
    code, err = _train(capsys, "--resume", str(tmp_path / "nowhere"))
    assert code == 2 and "no such directory" in err
    code, err = _train(capsys, "--resume", str(run / "checkpoints" / "step-000002"))
    assert code == 2 and "newer checkpoints (step-000004, step-000005)" in err
    code, err = _train(capsys, "--out", str(run), *common, "--seed", "9")  # not the same run
    assert code == 2 and "another configuration: --seed 9 (the run: 0)" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    shutil.rmtree(run / "checkpoints")
    code, err = _train(capsys, "--resume", str(run))
    assert code == 2 and "no complete checkpoint" in err and "--overwrite" in err


def test_overwrite_removes_the_old_checkpoints(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    common = (*CPU, "--recipe", "linear", "--batch-size", "100", "--epochs", "1")
    assert _train(capsys, "--out", str(run), *common, "--save-every", "3")[0] == 0
    assert len(list_checkpoints(run)) == 3
    (run / "checkpoints" / "mine.txt").write_text("kept")
    assert _train(capsys, "--out", str(run), *common, "--overwrite")[0] == 0
    assert [p.name for p in list_checkpoints(run)] == ["step-000010"]
    assert (run / "checkpoints" / "mine.txt").read_text() == "kept"


@pytest.mark.cuda
def test_fp16_on_cuda_resumes_the_grad_scaler_and_cuda_generator(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    common = ("--recipe", "linear", "--strategy", "cuda", "--precision", "fp16")
    common += ("--batch-size", "50", "--epochs", "2", "--save-every", "4")
    assert _train(capsys, "--out", str(tmp_path / "ref"), *common)[0] == 0
    assert _train(capsys, "--out", str(tmp_path / "run"), *common, "--max-steps", "9")[0] == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000009"
    assert read_torch(checkpoint / "scaler.pt")["scale"] > 0
    assert "cuda:0" in read_torch(checkpoint / "rng-rank0.pt")["cuda"]
    assert _train(capsys, "--resume", str(tmp_path / "run"), "--max-steps", "999")[0] == 0
    x = load_file(str(tmp_path / "ref" / "model.safetensors"))
    y = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert all(torch.allclose(x[k], y[k], rtol=0, atol=1e-6) for k in x)
