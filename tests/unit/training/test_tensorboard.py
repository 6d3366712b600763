"""TensorBoard logging: event files read back with tensorboard's own EventAccumulator."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import CLI

import paratrain
from paratrain.cli.main import main

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = event_accumulator.EventAccumulator(str(directory))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def _eval_lines(run: Path) -> list[dict[str, float]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "eval"]


@pytest.mark.slow
def test_train_tensorboard_logs_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train", "--strategy", "cpu", "--epochs", "2", "--lr", "0.05", "--no-progress"]
    assert main([*argv, "--batch-size", "256", "--tensorboard", "--out", str(run)]) == 0
    logged = scalars(run / "tensorboard")
    every_epoch = ("loss/train_epoch", "loss/eval", "accuracy/eval", "lr")
    assert set(every_epoch) | {"throughput/samples_per_second", "memory/peak_mib"} <= set(logged)
    evals = _eval_lines(run)
    # The same figures as metrics.jsonl, at the same optimizer steps.
    assert [s for s, _ in logged["accuracy/eval"]] == [r["step"] for r in evals]
    assert [v for _, v in logged["accuracy/eval"]] == pytest.approx([r["accuracy"] for r in evals])
    assert [v for _, v in logged["loss/eval"]] == pytest.approx([r["loss"] for r in evals])
    assert [v for _, v in logged["lr"]] == pytest.approx([0.05, 0.05])
    assert all(v > 0 for _, v in logged["throughput/samples_per_second"])
    assert all(v > 1 for _, v in logged["memory/peak_mib"])  # MiB of resident memory
    assert logged["loss/train"]  # per-step points, at least the first


def test_no_tensorboard_folder_without_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert (
        main(["train", "--strategy", "cpu", "--max-steps", "2", "--no-progress", "--out", str(run)])
        == 0
    )
    assert not (run / "tensorboard").exists()


@pytest.mark.slow
def test_overwrite_starts_a_fresh_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train", "--strategy", "cpu", "--max-steps", "2", "--no-progress", "--tensorboard"]
    assert main([*argv, "--out", str(run)]) == 0
    assert main([*argv, "--out", str(run), "--overwrite"]) == 0
    assert len(list((run / "tensorboard").iterdir())) == 1
    assert len(scalars(run / "tensorboard")["loss/eval"]) == 1


@pytest.mark.slow
def test_ddp_writes_from_the_main_process_only(tmp_path: Path, paratrain_here: CLI) -> None:
    run = tmp_path / "ddp"
    done = paratrain_here(
        "train", "--strategy", "ddp", "--devices", "cpu,cpu", "--max-steps", "3",
        "--no-progress", "--tensorboard", "--out", str(run),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(list((run / "tensorboard").iterdir())) == 1  # one event file: rank 0's
    logged = scalars(run / "tensorboard")
    assert [v for _, v in logged["accuracy/eval"]] == pytest.approx(
        [r["accuracy"] for r in _eval_lines(run)]
    )


class _Rank:
    def __init__(self, main: bool) -> None:
        self.is_main = main
        self.device = torch.device("cpu")


def test_logger_in_your_own_loop(tmp_path: Path) -> None:
    with paratrain.TensorBoardLogger(tmp_path, _Rank(True)) as logger:
        for step in range(3):
            logger.log({"loss": torch.tensor(1.0 / (step + 1)), "skipped": None}, step)
    assert scalars(tmp_path / "tensorboard") == {
        "loss": [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    }
    other = paratrain.TensorBoardLogger(tmp_path / "other", _Rank(False))
    other.log({"loss": 1.0}, 0)
    other.log_progress(0, None, 10.0)
    other.close()
    assert not other.enabled and not (tmp_path / "other").exists()


def test_missing_tensorboard_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard fails
    code = main(["train", "--tensorboard", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert 'pip install "paratrain[tensorboard]"' in err
    assert not (tmp_path / "run").exists()  # refused before anything was created


@pytest.mark.slow
def test_resume_may_add_tensorboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train", "--strategy", "cpu", "--batch-size", "256", "--no-progress"]
    assert main([*argv, "--epochs", "1", "--out", str(run)]) == 0
    assert main([*argv, "--resume", str(run), "--epochs", "2", "--tensorboard"]) == 0
    assert [s for s, _ in scalars(run / "tensorboard")["loss/eval"]] == [
        _eval_lines(run)[-1]["step"]
    ]
