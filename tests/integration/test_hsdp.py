"""HSDP (``--strategy fsdp --replicate R``) over real gloo processes on the CPU: FSDP2 on a
2 x 2 mesh trains the model one process trains, its checkpoints resume on one process and on
fsdp x4, and bad input is refused before any process starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.cli import main_in_process
from safetensors.torch import load_file

from paratrain.checkpoints.state.store import CHECKPOINTS

TOLERANCE = 1e-5
DIGITS = ("train", "--recipe", "digits", "--no-progress")
CPU4 = "cpu,cpu,cpu,cpu"  # four gloo processes, also where there are GPUs


def _train(capfd: pytest.CaptureFixture[str], *args: object) -> tuple[str, str]:
    code, out, err = main_in_process(capfd, *DIGITS, *args)
    assert code == 0, err[-3000:]
    return out, err


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_hsdp_2x2_trains_one_process_model_and_resumes_on_other_layouts(
    capfd: pytest.CaptureFixture[str],
    tmp_path: Path,
    digits_on_one_cpu: dict[str, torch.Tensor],
) -> None:
    """25 digits steps on a 2 x 2 mesh (sharded in pairs, two replicas) reach one process's
    weights; the step-25 checkpoint holds plain full tensors, and resumed to step 50 on one
    process and on fsdp x4 each ends as the uninterrupted one-process run."""
    hsdp = tmp_path / "hsdp"
    _train(capfd, "--strategy", "cpu", "--max-steps", 25, "--out", tmp_path / "cpu")
    out, _ = _train(
        capfd, "--strategy", "fsdp", "--devices", CPU4, "--replicate", 2, "--max-steps", 25,
        "--out", hsdp,
    )  # fmt: skip
    assert out.count("trained 0.6 epochs, 25 steps") == 1  # printed by rank 0 only
    one = load_file(str(tmp_path / "cpu" / "model.safetensors"))
    weights = load_file(str(hsdp / "model.safetensors"))
    figures = [f"hsdp 2x2 vs cpu after 25 steps: max abs diff {_diff(weights, one):.3g}"]
    assert _diff(weights, one) < TOLERANCE
    runtime = json.loads((hsdp / "config.json").read_text())["runtime"]
    assert runtime["mesh"] == {"replicate": 2, "shard": 2} and runtime["world_size"] == 4
    saved = load_file(str(hsdp / CHECKPOINTS / "step-000025" / "model.safetensors"))
    assert all(torch.equal(saved[k], weights[k]) for k in weights)  # full tensors

    for name, layout in [("one", ("--strategy", "cpu")), ("fsdp4", ("--devices", CPU4))]:
        run = tmp_path / name
        shutil.copytree(hsdp, run)
        if name == "fsdp4":  # the same strategy on 4 processes, one copy
            layout = ("--strategy", "fsdp", "--devices", CPU4, "--replicate", 1)
        out, _ = _train(capfd, "--resume", run, *layout, "--max-steps", 50)
        assert "50 steps" in out, out
        diff = _diff(load_file(str(run / "model.safetensors")), digits_on_one_cpu)
        figures.append(f"hsdp 2x2 -> {' '.join(map(str, layout))}, step 50 vs cpu: {diff:.3g}")
        assert diff < TOLERANCE
    print("\n" + "\n".join(figures))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ("--strategy", "ddp", "--devices", "cpu,cpu", "--replicate", "2"),
            "--replicate applies to --strategy fsdp, pipeline only, not ddp; drop --replicate "
            "or use --strategy fsdp",
        ),
        (
            ("--strategy", "fsdp", "--devices", "cpu,cpu,cpu", "--replicate", "2"),
            "--replicate 2 does not divide the 3 processes into equal copies; use one of 1, 3",
        ),
    ],
)
def test_bad_replicate_is_one_line_and_exit_2(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, options: tuple[str, ...], message: str
) -> None:
    out = tmp_path / "bad"
    code, _, err = main_in_process(capfd, *DIGITS, *options, "--out", out)
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()
