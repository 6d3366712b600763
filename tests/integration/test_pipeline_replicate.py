"""Pipeline x data parallel (``--strategy pipeline --replicate R``) over real gloo processes
on the CPU: 2 copies of a 2-stage pipeline train the model one process trains, uneven last
batch included, and their checkpoints resume on one process and on the same layout."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers.cli import main_in_process
from safetensors.torch import load_file

from paratrain.checkpoints.state.store import CHECKPOINTS

TOLERANCE = 1e-5
DIGITS = ("train", "--recipe", "digits", "--no-progress")
TWO_BY_TWO = ("--strategy", "pipeline", "--devices", "cpu,cpu,cpu,cpu", "--replicate", "2")


def _train(capfd: pytest.CaptureFixture[str], *args: object) -> str:
    code, out, err = main_in_process(capfd, *DIGITS, *args)
    assert code == 0, err[-3000:]
    return out


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _test_metrics(out: str) -> str:
    found = re.search(r"test loss [0-9.]+, test accuracy [0-9.]+%", out)
    assert found is not None, out
    return found.group(0)


@pytest.mark.slow
def test_pipeline_2x2_trains_one_process_model_and_resumes(
    capfd: pytest.CaptureFixture[str],
    tmp_path: Path,
    digits_on_one_cpu: dict[str, torch.Tensor],
) -> None:
    """25 digits steps on 2 copies of a 2-stage pipeline, saved; resumed to step 50 on one
    process and on the same 2 x 2 layout (whose steps 26-50 hold the epoch's last batch of
    29 samples, 15 and 14 per copy): both end within 1e-5 of one process's 50 steps, and
    evaluation counts the 360 test samples once (the same test figures as one process)."""
    pipeline = tmp_path / "pipeline"
    out = _train(capfd, *TWO_BY_TWO, "--max-steps", 25, "--out", pipeline)
    assert out.count("trained 0.6 epochs, 25 steps") == 1  # printed by rank 0 only
    runtime = json.loads((pipeline / "config.json").read_text())["runtime"]
    assert runtime["mesh"] == {"replicate": 2, "stage": 2} and runtime["world_size"] == 4
    assert (pipeline / CHECKPOINTS / "step-000025" / "model.safetensors").exists()

    one = tmp_path / "one"
    shutil.copytree(pipeline, one)
    one_out = _train(capfd, "--resume", one, "--strategy", "cpu", "--max-steps", 50)
    assert "50 steps" in one_out, one_out
    resumed = _diff(load_file(str(one / "model.safetensors")), digits_on_one_cpu)

    out = _train(capfd, "--resume", pipeline, "--max-steps", 50)
    assert "50 steps" in out, out
    same = _diff(load_file(str(pipeline / "model.safetensors")), digits_on_one_cpu)
    print(
        f"\npipeline 2x2 to step 25 -> cpu to 50 vs cpu: {resumed:.3g}"
        f"\npipeline 2x2 to step 25 -> pipeline 2x2 to 50 vs cpu: {same:.3g}"
    )
    assert resumed < TOLERANCE and same < TOLERANCE
    assert _test_metrics(out) == _test_metrics(one_out)


def test_a_pipeline_copy_of_one_stage_is_one_line_and_exit_2(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "bad"
    options = ("--strategy", "pipeline", "--devices", "cpu,cpu,cpu,cpu", "--replicate", "4")
    code, _, err = main_in_process(capfd, *DIGITS, *options, "--out", out)
    assert code == 2
    assert "--replicate 4 leaves one process per copy of the pipeline" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()
