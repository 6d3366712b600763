"""`paratrain data shard` and `paratrain train --data-dir` on a folder of tar shards: the
digits recipe streamed from shards trains to the same weights on one process and on two
(gloo), and a run killed (SIGKILL) twice within one epoch, and continued each
time from its last checkpoint ends bit-identical to the run never stopped.

Before: `--data-dir` was for cifar10-resnet18 only, and there was no `paratrain data`."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CLI, subprocess_env
from helpers.cli import run_paratrain
from safetensors.torch import load_file

from paratrain.cli.main import main

pytestmark = pytest.mark.slow  # several runs of the command, on real processes
pytest.importorskip("webdataset")

LAYOUTS = {"cpu": ["--strategy", "cpu"], "ddp": ["--strategy", "ddp", "--devices", "cpu,cpu"]}
#: 1,437 training samples of digits in batches of 64: 23 steps an epoch, 46 in all; one
#: thread a process, in this process as in a new one (bit-identical runs)
TRAIN = ["train", "--recipe", "digits", "--epochs", "2", "--batch-size", "64", "--no-progress"]
TRAIN += ["--threads", "1"]


#: the path of the uninterrupted run on a layout
Reference = Callable[[str], Path]


def paratrain(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return run_paratrain(*args, cwd=cwd, env=subprocess_env(**env), timeout=300)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("digits")
    result = paratrain("data", "shard", "--recipe", "digits", "--out", "shards", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("wrote 1437 training and 360 test samples of digits")
    assert len(list((folder / "shards").glob("train-*.tar"))) == 6  # 256 a shard
    return folder / "shards"


@pytest.fixture(scope="module")
def uninterrupted(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The run never stopped, on layout "cpu" or "ddp": trained once for the module's tests."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    done: dict[str, Path] = {}

    def run(layout: str) -> Path:
        if layout not in done:
            # in this process (its ranks start from the session's fork server)
            train = [*TRAIN, "--data-dir", str(shards), *LAYOUTS[layout], "--save-every", "5"]
            assert main([*train, "--out", str(folder / layout)]) == 0
            lines = (folder / layout / "metrics.jsonl").read_text().splitlines()
            assert [json.loads(line)["step"] for line in lines][-1] == 46
            done[layout] = folder / layout
        return done[layout]

    return run


def test_shards_train_to_the_same_weights_on_one_process_and_two(
    uninterrupted: Reference,
) -> None:
    one, two = weights(uninterrupted("cpu")), weights(uninterrupted("ddp"))
    for key in one:
        torch.testing.assert_close(one[key], two[key], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["cpu", "ddp"])
def test_a_run_killed_twice_in_one_epoch_ends_bit_identical(
    layout: str, shards: Path, uninterrupted: Reference, tmp_path: Path, paratrain_here: CLI
) -> None:
    """Checkpoints every 5 steps; killed after steps 29 (epoch 1, from the start) and 38
    (epoch 1 again, from step 25's checkpoint), then run to the end from step 35's: a second
    resume inside one epoch continues where the first left off. (Resuming inside epoch 0 is
    test_streaming's.)"""
    train = [*TRAIN, "--data-dir", str(shards), *LAYOUTS[layout], "--save-every", "5", "--out"]
    rank = "0" if layout == "cpu" else "1"
    for step, resumed in ((29, None), (38, 25)):
        result = paratrain(*train, "run", cwd=tmp_path, PARATRAIN_TEST_FAULT=f"kill:{rank}:{step}")
        assert result.returncode != 0, result.stderr[-3000:]
        if resumed is not None:
            assert f"continuing from run/checkpoints/step-{resumed:06d}" in result.stderr
    result = paratrain_here(*train, "run")  # the last leg in this process
    assert result.returncode == 0, result.stderr[-3000:]
    assert "continuing from run/checkpoints/step-000035" in result.stderr
    reference = uninterrupted(layout)
    ref, run = weights(reference), weights(tmp_path / "run")
    assert all(torch.equal(ref[key], run[key]) for key in ref)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert metrics == (reference / "metrics.jsonl").read_text()
