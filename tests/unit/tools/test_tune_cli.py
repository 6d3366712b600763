"""`paratrain tune` without Ray: bad input, a missing Ray, and the loop's per-epoch hook."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import subprocess_env

from paratrain.runtime.facade import Runtime
from paratrain.training import rundir
from paratrain.training.config import TrainConfig
from paratrain.training.loop import train
from paratrain.training.recipes import get_recipe

BAD_INPUT = [
    ["--space", "lr=loguniform(1e-3"],
    ["--space", "lr=gauss(0,1)"],
    ["--space", "momentum=uniform(0.1,0.9)"],
    ["--space", "lr=choice(0.1)", "--metric", "eval_f1"],
    ["--recipe", "linear", "--space", "lr=choice(0.1)", "--metric", "eval_accuracy"],
    ["--space", "lr=choice(0.1)", "--strategy", "warp"],
    ["--resume", "search", "--trials", "8"],
]


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_code_2_before_ray_is_even_imported(
    tmp_path: Path,
) -> None:
    code = f"""
import sys
from paratrain.cli.main import main
codes = [main(["tune", *args, "--out", "search"]) for args in {BAD_INPUT!r}]
print(codes, "ray" in sys.modules)
"""
    result = _run_python(code, tmp_path)
    assert result.stdout.split("]")[0] == "[" + ", ".join(["2"] * len(BAD_INPUT))
    assert result.stdout.strip().endswith("False"), result.stdout  # Ray never imported
    lines = result.stderr.strip().splitlines()
    assert len(lines) == len(BAD_INPUT), result.stderr
    assert all(line.startswith("paratrain: error: ") for line in lines)
    assert "unknown distribution 'gauss'" in lines[1]
    assert "cannot tune 'momentum'; tunable: lr, batch_size" in lines[2]
    assert "--metric eval_f1: recipe digits reports eval_accuracy, eval_loss" in lines[3]
    assert "recipe linear reports eval_loss, train_loss" in lines[4]
    assert "unknown strategy 'warp'" in lines[5]
    assert "--resume search continues the search as it was started; drop --out" in lines[6]
    assert not (tmp_path / "search").exists()


@pytest.mark.slow
def test_without_ray_the_command_says_how_to_get_it(tmp_path: Path) -> None:
    code = """
import sys
sys.modules["ray"] = None  # as if Ray were not installed
from paratrain.cli.main import main
sys.exit(main(["tune", "--space", "lr=choice(0.1)", "--out", "search"]))
"""
    result = _run_python(code, tmp_path)
    assert result.returncode == 2
    needs = 'paratrain tune needs Ray: pip install "paratrain[tune]"'
    assert result.stderr == f"paratrain: error: {needs}\n"
    assert not (tmp_path / "search").exists()


@pytest.mark.slow
def test_optuna_missing_is_named_before_ray_starts(tmp_path: Path) -> None:
    code = """
import sys
sys.modules["optuna"] = None
from paratrain.cli.main import main
sys.exit(main(["tune", "--space", "lr=loguniform(0.01,0.1)", "--search", "optuna"]))
"""
    result = _run_python(code, tmp_path)
    assert result.returncode == 2
    assert 'needs Optuna: pip install "paratrain[tune-optuna]"' in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="needs pip install 'paratrain[tune]': without Ray, the answer is how to install it",
)
def test_an_existing_search_is_not_replaced_without_overwrite(tmp_path: Path) -> None:
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "tune.json").write_text("{}", encoding="utf-8")
    code = """
import sys
from paratrain.cli.main import main
sys.exit(main(["tune", "--space", "lr=choice(0.1)", "--out", "search"]))
"""
    result = _run_python(code, tmp_path)
    assert result.returncode == 2
    assert "already holds a search (tune.json); continue it with --resume search" in result.stderr
    assert (tmp_path / "search" / "tune.json").read_text(encoding="utf-8") == "{}"


@pytest.mark.slow
def test_on_epoch_is_called_after_every_epoch_with_its_figures(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = []
    cfg = TrainConfig(recipe="linear", strategy="cpu", epochs=3, progress=False)
    cfg = cfg.resolved(get_recipe)
    summary = train(Runtime(strategy="cpu", seed=0), cfg, tmp_path, on_epoch=records.append)
    assert [r["epoch"] for r in records] == [0, 1, 2]
    lines = [json.loads(line) for line in (tmp_path / rundir.METRICS).read_text().splitlines()]
    evals = [line for line in lines if line["split"] == "eval"]
    assert [r["eval_loss"] for r in records] == [line["loss"] for line in evals]
    assert [r["step"] for r in records] == [line["step"] for line in evals]
    assert records[-1]["train_loss"] == summary.train_loss
    assert records[-1]["eval_accuracy"] is None  # a regression recipe
