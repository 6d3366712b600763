"""Stopping on a signal without losing work, and the same command continuing the run
(`--strategy cpu`, in this process; the multi-process layouts: conftest's stop-and-resume
helper for fsdp and pipeline, and tests/test_clusters.py for ddp under SLURM and torchrun)."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import paratrain_test_faults as faults
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.cli.main import main
from paratrain.launching import preemption
from paratrain.training import run_lock
from paratrain.training.autoresume import differences, set_aside
from paratrain.training.config import TrainConfig


@pytest.fixture(autouse=True)
def fresh_handlers() -> Iterator[None]:
    """Python's signal handlers and no stop request, before and after each test."""
    preemption.reset()
    faults.reset()
    yield
    preemption.reset()
    faults.reset()


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# -- the signal handlers (this process) ----------------------------------------------------


def test_a_signal_is_a_request_and_a_second_ctrl_c_stops_at_once() -> None:
    preemption.watch()
    os.kill(os.getpid(), signal.SIGTERM)
    request = preemption.requested()
    assert request is not None and request.name == "SIGTERM" and request.exit_code == 143
    assert preemption.agree(paratrain.distributed.collective.Collective()) == request  # one process
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: one more request, kept the first
    assert preemption.requested() == request
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_a_launcher_passes_each_signal_on_and_stops_on_a_second_ctrl_c() -> None:
    sent: list[int] = []
    with preemption.forwarding(sent.append) as received:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert sent == [signal.SIGUSR1, signal.SIGINT, signal.SIGINT]
    assert [r.name for r in received] == ["SIGUSR1"]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # put back


# -- paratrain train --strategy cpu ---------------------------------------------------------

# digits: 23 steps per epoch at --batch-size 64
COMMON = ("train", "--strategy", "cpu", "--batch-size", "64", "--max-steps", "30", "--seed", "3")
COMMON += ("--no-progress", "--save-every", "10")


@pytest.mark.slow
def test_a_signal_at_a_random_step_then_the_same_command_ends_bit_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main([*COMMON, "--out", str(tmp_path / "ref")]) == 0
    step = random.randint(1, 29)
    # and the last step of the first epoch, where the checkpoint holds a trained-out epoch
    for where, (kind, at) in {"run": ("sigterm", step), "edge": ("sigusr1", 23)}.items():
        out = str(tmp_path / where)
        monkeypatch.setenv(faults.FAULT_VARIABLE, f"{kind}:0:{at}")
        faults.reset()
        capsys.readouterr()
        code = main([*COMMON, "--out", out])
        err = capsys.readouterr().err
        assert code == 128 + getattr(signal, kind.upper()), err
        line = f"paratrain: stopped by {kind.upper()} after step {at}: checkpoint {out}/"
        # a busy machine may add a note on threads first: the stop is the first other line
        said = "".join(x for x in err.splitlines(True) if not x.startswith("paratrain: note:"))
        assert said.startswith(line + f"checkpoints/step-{at:06d} is complete"), (step, err)
        assert said.count("\n") == 1 and "s after the signal" in said
        assert (Path(out) / "checkpoints" / f"step-{at:06d}").is_dir()
        monkeypatch.delenv(faults.FAULT_VARIABLE)
        preemption.reset()
        assert main([*COMMON, "--out", out]) == 0  # the same command: continues
        err = capsys.readouterr().err
        assert f"unfinished: continuing from {out}/checkpoints/step-{at:06d}" in err
        assert _same_weights(tmp_path / "ref", Path(out)), (kind, at)
        ref_metrics = (tmp_path / "ref" / "metrics.jsonl").read_text()
        assert (Path(out) / "metrics.jsonl").read_text() == ref_metrics
    # once more: finished, nothing to do; another configuration is refused
    assert main([*COMMON, "--out", str(tmp_path / "run")]) == 0
    assert "finished; nothing to do" in capsys.readouterr().err
    assert main([*COMMON, "--out", str(tmp_path / "run"), "--lr", "0.5", "--seed", "4"]) == 2
    err = capsys.readouterr().err
    assert "another configuration: --lr 0.5 (the run: 0.02); --seed 4 (the run: 3)" in err, err


def test_fresh_moves_the_old_run_aside(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"status": "running", "config": {}}')
    (out / "metrics.jsonl").write_text("{}\n")
    moved = set_aside(str(out))
    assert moved is not None and moved.name.startswith("run.before-") and not out.exists()
    assert (moved / "metrics.jsonl").read_text() == "{}\n"  # nothing lost
    assert set_aside(str(out)) is None  # no run there: nothing to move
    assert main(["train", "--resume", str(moved), "--fresh"]) == 2
    assert "drop one" in capsys.readouterr().err


def test_fresh_leaves_this_commands_lock_on_out(tmp_path: Path) -> None:
    """The lock --fresh holds while it moves the old run belongs to the new run: it stays on
    --out, and the old run's folder is left without it."""
    out = tmp_path / "run"
    with run_lock.hold(out):
        (out / "config.json").write_text('{"status": "running", "config": {}}')
        moved = set_aside(str(out))
        assert moved is not None and not (moved / run_lock.LOCK).exists()
        assert (out / run_lock.LOCK).is_file() and (moved / "config.json").is_file()
    assert not (out / run_lock.LOCK).exists()  # released as usual


def test_changeable_options_are_not_differences() -> None:
    saved = TrainConfig(epochs=2, batch_size=8, lr=0.1, strategy="ddp", devices="cpu,cpu")
    wanted = TrainConfig(epochs=5, batch_size=8, lr=0.1, strategy="cpu", max_steps=9)
    assert differences(saved, wanted) == []
    wanted.precision, wanted.accumulate = "bf16", 2
    assert differences(saved, wanted) == [
        "--precision bf16 (the run: 32)",
        "--accumulate 2 (the run: 1)",
    ]


# -- your own loop ---------------------------------------------------------------------------


def _own_loop(path: Path, signal_at: int | None = None) -> tuple[nn.Module, int | None]:
    """A user's loop: rt.should_stop() after each step, rt.save, rt.exit_stopped()."""
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 6, generator=generator), torch.randn(96, 1))
    loader = rt.setup_loader(DataLoader(data, 16, shuffle=True))
    parts = {"model": model, "optimizer": optimizer}
    start, batch, step = 0, 0, 0
    if path.exists():
        state = rt.load(path, parts)
        start, batch, step = state["epoch"], state["batch"], state["step"]
    try:
        for epoch in range(start, 3):
            loader.set_epoch(epoch, start_batch=batch)
            for x, y in loader:
                optimizer.zero_grad()
                rt.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                batch, step = batch + 1, step + 1
                if step == signal_at:
                    os.kill(os.getpid(), signal.SIGTERM)
                if rt.should_stop():
                    rt.save(path, {**parts, "epoch": epoch, "batch": batch, "step": step})
                    rt.exit_stopped(path, step)
            batch = 0
    except preemption.Stopped as stopped:
        return model, stopped.code  # type: ignore[return-value]
    return model, None


def test_your_own_loop_stops_on_a_signal_and_resumes_bit_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference, _ = _own_loop(tmp_path / "a.pt")
    _, code = _own_loop(tmp_path / "b.pt", signal_at=random.randint(1, 17))
    assert code == 143
    assert "paratrain: stopped by SIGTERM after step" in capsys.readouterr().err
    preemption.reset()
    resumed, code = _own_loop(tmp_path / "b.pt")
    assert code is None
    pairs = zip(reference.parameters(), resumed.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)
