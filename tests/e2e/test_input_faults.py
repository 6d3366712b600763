"""Input an adversarial user gives: each case one line, the right exit code, nothing
written. In this process, `--strategy cpu` (or `--devices cpu,cpu` where the check needs a
multi-process strategy; nothing is started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cli import main_in_process

import paratrain
from paratrain.cli.main import main
from paratrain.utils.errors import UserError

LINEAR = ("--strategy", "cpu", "--recipe", "linear", "--batch-size", "100")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code, out, err = main_in_process(capsys, *argv)
    assert "Traceback" not in err
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "inf"], "--lr must be a positive number, got inf"),
        (["--seed", "99999999999999999999999"], "--seed must be between 0 and 2**63-1"),
        (["--strategy", "cpu", "--fsdp-blocks", "Foo"], "--fsdp-blocks applies to --strategy fsdp"),
        (
            ["--strategy", "fsdp", "--devices", "cpu,cpu", "--pipeline-split", "blocks.2"],
            "--pipeline-split applies to --strategy pipeline only, not fsdp",
        ),
        (
            ["--strategy", "cpu", "--pipeline-microbatches", "0"],
            "--pipeline-microbatches applies to --strategy pipeline only",
        ),
        (
            ["--strategy", "cpu", "--batch-size", "1000000000"],
            "--batch-size 1000000000 is larger than the training set (1437 samples)",
        ),
    ],
)
def test_options_that_cannot_apply_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    out = tmp_path / "bad"
    code, _, err = _run(capsys, "train", "--no-progress", "--out", str(out), *argv)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.fixture
def finished(tmp_path: Path) -> Path:
    """A linear run of 2 epochs (20 steps) that --max-steps ended, --epochs 3 asked."""
    run = tmp_path / "run"
    argv = ["train", "--no-progress", "--out", str(run), *LINEAR, "--epochs", "3"]
    assert main([*argv, "--max-steps", "20", "--save-every", "5"]) == 0
    return run


def test_a_damaged_config_json_is_named(finished: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = finished / "config.json"
    payload = json.loads(path.read_text())
    payload["config"]["batch_size"] = "abc"
    path.write_text(json.dumps(payload))
    code, _, err = _run(capsys, "train", "--resume", str(finished), "--max-steps", "30")
    assert code == 2 and err.count("\n") == 1
    assert f"{path} is damaged: batch_size is 'abc', not int or null" in err


def test_resuming_the_final_checkpoint_and_a_short_metrics_file(
    finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed after its last checkpoint, before it was marked finished: resuming trains
    nothing and counts the 2 epochs trained; a metrics.jsonl that lost a line says so."""
    config = finished / "config.json"
    config.write_text(config.read_text().replace('"finished"', '"running"'))
    metrics = finished / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:-1]))
    code, out, err = _run(capsys, "train", "--no-progress", "--resume", str(finished))
    assert code == 0
    assert "trained 2 epochs, 20 steps" in out
    assert f"{metrics} has {len(lines) - 1} line(s), the checkpoint recorded {len(lines)}" in err


def test_inspecting_a_checkpoint_without_weights_names_what_is_missing(
    finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = finished / "checkpoints" / "step-000020"
    (checkpoint / "model.safetensors").unlink()
    code, _, err = _run(capsys, "ckpt", "inspect", str(checkpoint))
    assert code == 2 and err.count("\n") == 1
    assert "model.safetensors is missing: this checkpoint has no weights" in err
    assert "optimizer.pt" not in err and "rng-rank0.pt" not in err


def test_load_quantized_on_random_bytes_gives_no_unsafe_advice(tmp_path: Path) -> None:
    pytest.importorskip("torchao")  # without it, the answer is how to install it
    path = tmp_path / "model-int8.pt"
    path.write_bytes(bytes(range(256)) * 16)
    with pytest.raises(UserError) as caught:
        paratrain.load_quantized(path)
    assert "not a quantized model written by paratrain export" in str(caught.value)
    assert "weights_only" not in str(caught.value)


@pytest.mark.slow
def test_resuming_with_another_strategy_drops_the_options_of_the_first(
    finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run trained with fsdp's options, resumed with --strategy cpu: they no longer apply
    and are dropped, rather than refused."""
    path = finished / "config.json"
    payload = json.loads(path.read_text())
    payload["config"].update(strategy="fsdp", fsdp_blocks="Linear")
    path.write_text(json.dumps(payload))
    argv = ["train", "--no-progress", "--resume", str(finished), "--strategy", "cpu"]
    code, _, err = _run(capsys, *argv, "--max-steps", "22")
    assert code == 0, err
    assert json.loads(path.read_text())["config"]["fsdp_blocks"] is None
