"""Real searches on a real (embedded) Ray: ASHA on digits, Ctrl+C and --resume, ddp trials."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import CLI, subprocess_env
from helpers.cli import run_paratrain, start_paratrain

import paratrain
from paratrain.models import DigitsCNN

pytest.importorskip("ray.tune")
pytestmark = pytest.mark.slow


def _report(out: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads((out / "tune.json").read_text(encoding="utf-8"))
    return report


def test_asha_search_on_digits_stops_the_bad_trials_and_keeps_the_best_run(
    paratrain_cli: CLI, tmp_path: Path
) -> None:
    # One trial at a time, in grid order: lr=0.05 learns, lr=1e-5 does not. ASHA's first
    # rung is after epoch 1 (grace period 1); keeping the top half (reduction factor 2), it
    # stops the lr=1e-5 trial there, below the lr=0.05 trial already recorded.
    result = paratrain_cli(
        "tune",
        "--recipe",
        "digits",
        "--strategy",
        "cpu",
        "--space",
        "lr=grid(0.05,0.00001)",
        "--trials",
        "1",
        "--epochs",
        "3",
        "--scheduler",
        "asha",
        "--max-concurrent",
        "1",
        "--out",
        "search",
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "search"
    report = _report(out)
    assert report["status"] == "finished"
    assert report["scheduler"] == {
        "name": "asha",
        "time_attr": "training_iteration (epochs)",
        "max_t": 3,
        "grace_period": 1,
        "reduction_factor": 2,
    }
    trials = report["trials"]
    assert len(trials) == 2
    good = [t for t in trials if t["config"] == {"lr": 0.05}]
    bad = [t for t in trials if t["config"] == {"lr": 0.00001}]
    assert [(t["status"], t["epochs"]) for t in good] == [("finished", 3)]
    assert [(t["status"], t["epochs"]) for t in bad] == [("stopped", 1)]
    assert all(t["best"] > 0.9 for t in good) and all(t["best"] < 0.5 for t in bad)
    for trial in trials:  # every trial is a paratrain run directory
        run = out / trial["directory"]
        assert (run / "config.json").is_file() and (run / "metrics.jsonl").is_file()

    best = report["best"]
    assert best["id"] in {t["id"] for t in good} and best["copied_to"] == "best"
    copied = out / "best"
    original = out / best["directory"]
    for name in ("model.safetensors", "metrics.jsonl", "config.json"):
        assert (copied / name).read_bytes() == (original / name).read_bytes()
    assert json.loads((copied / "config.json").read_text())["status"] == "finished"
    loaded = paratrain.load_weights(DigitsCNN(), copied)
    assert loaded.loaded and not loaded.mismatched
    inspect = paratrain_cli("ckpt", "inspect", "search/best")
    assert inspect.returncode == 0, inspect.stderr
    assert (out / "tune.png").stat().st_size > 0

    # the table: every trial with its configuration, epochs and status, the best marked
    assert f"* {best['id']}" in result.stdout
    for trial in trials:
        assert trial["id"] in result.stdout
    assert result.stdout.count("stopped") == 1 and result.stdout.count("finished") == 1


def test_an_interrupted_search_continues_with_resume(tmp_path: Path) -> None:
    # Optuna samples; each epoch's checkpoint takes a second longer (a test hook), so that
    # Ctrl+C after the first finished trial comes with the second left to run.
    args = ["tune", "--strategy", "cpu", "--epochs", "2"]
    args += ["--space", "lr=loguniform(0.01,0.1)", "--space", "batch_size=choice(32,64)"]
    args += ["--search", "optuna", "--scheduler", "fifo", "--trials", "2", "--max-concurrent"]
    args += ["1", "--no-progress", "--out", "search"]
    env = subprocess_env(PARATRAIN_TEST_STALL_SAVE="1")
    process = start_paratrain(*args, cwd=tmp_path, env=env)
    out = tmp_path / "search"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and process.poll() is None:
        statuses = [
            json.loads(path.read_text(encoding="utf-8")).get("status")
            for path in out.glob("trials/*/config.json")
        ]
        if "finished" in statuses:
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert f"continue it with: paratrain tune --resume {Path('search')}" in stdout
    report = _report(out)
    assert report["status"] == "interrupted"
    finished = {t["id"] for t in report["trials"] if t["status"] == "finished"}
    assert len(finished) == 1
    before = {i: (out / "trials" / i / "metrics.jsonl").read_bytes() for i in finished}

    resumed = run_paratrain(
        "tune", "--resume", "search", "--no-progress", cwd=tmp_path, timeout=200
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = _report(out)
    assert report["status"] == "finished"
    assert len(report["trials"]) == 2
    assert all(t["status"] == "finished" and t["epochs"] == 2 for t in report["trials"])
    assert report["settings"]["search"] == "optuna"
    for trial in report["trials"]:  # each epoch once: continued, never trained twice
        lines = (out / trial["directory"] / "metrics.jsonl").read_text().splitlines()
        epochs = [json.loads(line)["epoch"] for line in lines]
        assert epochs == [0, 0, 1, 1]
    for trial_id, metrics in before.items():  # finished trials are left as they were
        assert (out / "trials" / trial_id / "metrics.jsonl").read_bytes() == metrics
    assert (out / "best" / "model.safetensors").is_file()


def test_a_ddp_trial_runs_two_processes_and_reports_every_epoch(
    paratrain_cli: CLI, tmp_path: Path
) -> None:
    result = paratrain_cli(
        "tune",
        "--strategy",
        "ddp",
        "--devices",
        "cpu,cpu",
        "--space",
        "lr=choice(0.05)",
        "--trials",
        "1",
        "--epochs",
        "2",
        "--no-progress",
        "--no-plot",
        "--tensorboard",  # options of `paratrain train` reach every trial's run
        "--save-every",
        "20",
        "--out",
        "search",
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    best = tmp_path / "search" / "best"
    assert any((best / "tensorboard").glob("events.out.tfevents.*"))
    # 45 steps an epoch, saved every 20 too: the newest three of 20, 40, 45, 60, 80, 90
    kept = sorted(path.name for path in (best / "checkpoints").iterdir())
    assert kept == ["step-000060", "step-000080", "step-000090"], kept
    report = _report(tmp_path / "search")
    assert report["settings"]["resources"] == {"cpus": 2.0, "gpus": 0.0}
    (trial,) = report["trials"]
    assert (trial["status"], trial["epochs"]) == ("finished", 2)
    config = json.loads((tmp_path / "search" / "best" / "config.json").read_text())
    assert config["runtime"]["world_size"] == 2
    result_lines = (tmp_path / "search" / "ray" / trial["id"] / "result.json").read_text()
    reported = [json.loads(line) for line in result_lines.splitlines()]
    assert [r["epoch"] for r in reported] == [1, 2]  # from rank 0, through the trial process
    assert [r["eval_accuracy"] for r in reported] == trial["history"]
