"""Real `paratrain train` processes killed with SIGKILL, during training and during a save,
then resumed: the final weights are bit-identical to a run that was never interrupted.

The killed run is a command of its own; the reference and the resumed runs are run in this
process (their ranks start from the session's fork server), with the thread count given so
that the two agree whatever this process's own settings."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env
from helpers.cli import start_paratrain
from paratrain_test_faults import STALL_VARIABLE
from safetensors.torch import load_file

from paratrain.checkpoints.files import load_weights
from paratrain.checkpoints.state import list_checkpoints, read_state
from paratrain.cli.main import main
from paratrain.models import DigitsCNN

pytestmark = pytest.mark.slow  # real processes, or several layers at work


# 23 batches (steps) per epoch, a checkpoint every 4 steps, one thread per process
SETTINGS = ("--epochs", "1", "--batch-size", "64", "--save-every", "4", "--seed", "1")
SETTINGS += ("--threads", "1")
CPU = ("--strategy", "cpu")
DDP = ("--strategy", "ddp", "--devices", "cpu,cpu")
TIMEOUT = 240.0


def _run(capfd: pytest.CaptureFixture[str] | None, *argv: str) -> str:
    """``paratrain train ARGV`` in this process; what it said on stderr (with ``capfd``)."""
    if capfd is not None:
        capfd.readouterr()
    assert main(["train", "--no-progress", *argv]) == 0
    return capfd.readouterr().err if capfd is not None else ""


def _kill_when(run: Path, ready: Callable[[], bool], *argv: str, stall: str = "") -> None:
    """Start a run into ``run``; SIGKILL it (every process of it) once ``ready()``."""
    # TMPDIR: what the killed launcher cannot clean up stays inside the test's folder
    env = subprocess_env(TMPDIR=str(run.parent), **({STALL_VARIABLE: stall} if stall else {}))
    log = open(run.parent / f"{run.name}.log", "w")  # noqa: SIM115
    process = start_paratrain(
        "train",
        "--no-progress",
        "--out",
        str(run),
        *argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group: the spawned ranks die with it
    )
    deadline = time.monotonic() + TIMEOUT
    try:
        while not ready():
            if process.poll() is not None:
                log.close()
                text = (run.parent / f"{run.name}.log").read_text()
                pytest.fail(f"the run ended before it could be killed:\n{text}")
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
    assert process.returncode == -signal.SIGKILL
    assert json.loads((run / "config.json").read_text())["status"] == "running"
    assert not (run / "model.safetensors").exists()


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _stalled_save(run: Path) -> bool:
    """A complete checkpoint exists and a later one is written, not yet renamed. The
    complete ones are listed first: a pending one seen before them may be the one that
    became complete in between."""
    complete = list_checkpoints(run)
    root = run / "checkpoints"
    pending = [p.parent.name for p in root.glob(".step-*.tmp/state.json")] if complete else []
    return any(name > f".{complete[-1].name}.tmp" for name in pending)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    _run(None, "--out", str(out), *SETTINGS, *CPU)
    return out


def test_killed_during_training_resumes_bit_identical(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _kill_when(run, lambda: bool(list_checkpoints(run)), *SETTINGS, *CPU)
    _run(None, "--resume", str(run))
    assert _same_weights(reference, run)
    assert (run / "metrics.jsonl").read_text() == (reference / "metrics.jsonl").read_text()


def test_killed_during_a_save_keeps_the_previous_checkpoint(
    reference: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    _kill_when(run, lambda: _stalled_save(run), *SETTINGS, *CPU, stall="1.5")
    leftovers = list((run / "checkpoints").glob(".step-*.tmp"))
    assert [p.name for p in leftovers] == [".step-000008.tmp"]
    (previous,) = list_checkpoints(run)
    assert previous.name == "step-000004" and read_state(previous)["step"] == 4
    assert load_weights(DigitsCNN(), previous).ok
    torch.load(previous / "optimizer.pt", weights_only=True)
    _run(None, "--resume", str(run))
    config = json.loads((run / "config.json").read_text())
    assert config["config"]["resume_from"].endswith("step-000004")
    assert not leftovers[0].exists()  # cleaned by the next save
    assert _same_weights(reference, run)


def test_ddp_killed_during_training_resumes_bit_identical(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    reference = tmp_path / "reference"
    _run(None, "--out", str(reference), *SETTINGS, *DDP)
    run = tmp_path / "run"
    _kill_when(run, lambda: bool(list_checkpoints(run)), *SETTINGS, *DDP)
    checkpoint = list_checkpoints(run)[-1]  # a busy machine may write one more before the kill
    assert read_state(checkpoint)["world_size"] == 2
    assert {p.name for p in checkpoint.glob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}
    one = tmp_path / "one-process"
    shutil.copytree(run, one)
    _run(None, "--resume", str(run))
    assert _same_weights(reference, run)
    assert (run / "metrics.jsonl").read_text() == (reference / "metrics.jsonl").read_text()
    # Another world size: the data position maps exactly; only float sums differ.
    note = _run(capfd, "--resume", str(one), "--strategy", "cpu")
    assert "saved by 2 process(es), this run has 1" in note
    x, y = (
        load_file(str(reference / "model.safetensors")),
        load_file(str(one / "model.safetensors")),
    )
    assert all(torch.allclose(x[k], y[k], atol=1e-4) for k in x)
