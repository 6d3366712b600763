"""The promise: the same seed and global batch give the same weights on every layout.

`paratrain train` runs the digits recipe in fp32 for 50 optimizer steps (into a second
epoch, through an uneven last batch) on one CPU process, ddp, fsdp and pipeline (1F1B and
GPipe) with 2 and with 3 gloo processes, and the balanced DataParallel on ``cpu,cpu``; the
saved weights must agree within 1e-5. The command runs in this process (its processes start
from the test session's fork server): what is compared is the layouts, not the command
line's start-up, which tests/e2e runs in new processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cli import main_in_process
from safetensors.torch import load_file

from paratrain.strategies import strategy_names

pytestmark = pytest.mark.slow  # real processes, or several layers at work


TOLERANCE = 1e-5
LAYOUTS = [
    ("ddp", "cpu,cpu"),
    ("ddp", "cpu,cpu,cpu"),
    ("fsdp", "cpu,cpu"),
    ("fsdp", "cpu,cpu,cpu"),
    ("pipeline", "cpu,cpu"),
    ("pipeline --pipeline-schedule gpipe", "cpu,cpu,cpu"),
    pytest.param(
        "dp-balanced",
        "cpu,cpu",
        marks=pytest.mark.skipif(
            "dp-balanced" not in strategy_names(), reason="dp-balanced is not registered"
        ),
    ),
]


def train(
    capfd: pytest.CaptureFixture[str], out: Path, strategy: str, devices: str | None
) -> tuple[dict[str, torch.Tensor], str]:
    """Weights and stdout of ``paratrain train`` (digits, 50 steps, default seed)."""
    args = ["train", "--recipe", "digits"]
    args += [
        "--strategy",
        *strategy.split(),
        "--max-steps",
        "50",
        "--no-progress",
        "--out",
        str(out),
    ]
    if devices is not None:
        args += ["--devices", devices]
    code, stdout, err = main_in_process(capfd, *args)
    assert code == 0, err[-3000:]
    return load_file(str(out / "model.safetensors")), stdout


@pytest.fixture
def reference(digits_on_one_cpu: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return digits_on_one_cpu  # the same command as train(..., "cpu", None), run once


@pytest.mark.parametrize(("strategy", "devices"), LAYOUTS)
def test_weights_after_50_steps_match_one_process(
    strategy: str,
    devices: str,
    reference: dict[str, torch.Tensor],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    weights, stdout = train(capfd, tmp_path / "run", strategy, devices)
    assert weights.keys() == reference.keys()
    diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
    print(f"\n{strategy} --devices {devices} vs cpu after 50 steps: max abs diff {diff:.3g}")
    assert diff < TOLERANCE
    assert stdout.count("trained 1.1 epochs, 50 steps") == 1  # printed by rank 0 only
