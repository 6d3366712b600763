"""`paratrain bench loader`: the sweep, the recommendation and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paratrain.cli.main import main
from paratrain.tools.bench.loader import LoaderRow, LoaderSetting, recommend, worker_counts
from paratrain.tools.bench.noise import within_noise
from paratrain.tools.bench.stats import Spread

SCRIPT = """
import torch
from torch import nn


def sample_batch(n):
    return torch.randn(n, 8), torch.randint(0, 3, (n,))


def factory():
    return nn.Linear(8, 3), nn.CrossEntropyLoss(), sample_batch
"""


def _s(median: float, width: float = 0.0) -> Spread:
    return Spread(median, median - width, median + width, 3)


def _row(workers: int, loader: float, training: float, width: float = 0.0) -> LoaderRow:
    return LoaderRow(LoaderSetting(workers, False), _s(loader), _s(training, width))


def test_worker_counts_double_up_to_the_limit() -> None:
    assert worker_counts(2) == [0, 1, 2]
    assert worker_counts(6) == [0, 1, 2, 4]
    assert worker_counts(0) == [0]
    assert worker_counts()[:2] == [0, 1]


def test_slow_steps_mean_the_loader_is_not_the_bottleneck() -> None:
    rows = [_row(0, 500.0, 9.8, 0.3), _row(1, 300.0, 10.0, 0.3), _row(2, 400.0, 9.9, 0.3)]
    setting, bottleneck, message = recommend(rows, _s(10.0, 0.2))
    assert setting == LoaderSetting(0, False)  # a tie: the cheapest setting
    assert not bottleneck
    assert "not the bottleneck" in message and "tied with 2" in message


def test_a_slow_loader_is_the_bottleneck_and_workers_win() -> None:
    rows = [_row(0, 20.0, 15.0, 0.5), _row(1, 45.0, 38.0, 0.5), _row(2, 80.0, 70.0, 0.5)]
    setting, bottleneck, message = recommend(rows, _s(100.0, 1.0))
    assert setting == LoaderSetting(2, False)
    assert bottleneck
    assert "data path limits training" in message and "tied" not in message


def test_the_recommendation_follows_the_table() -> None:
    # 0 workers trains slower; 1 and 2 tie: 1 is recommended, and the message says why
    # fewer would not do, instead of claiming the data path never matters.
    rows = [_row(0, 50.0, 8.0, 0.1), _row(1, 300.0, 10.0, 0.1), _row(2, 400.0, 10.1, 0.1)]
    setting, bottleneck, message = recommend(rows, _s(10.5, 0.2))
    assert setting == LoaderSetting(1, False) and not bottleneck
    assert "fewer workers train slower (num_workers=0, pin_memory=False: 8.0" in message
    for widths in ((0.1, 0.1, 0.1), (2.0, 0.1, 0.1), (0.1, 0.1, 3.0)):
        rates = zip((0, 1, 2), (8.0, 10.0, 10.1), widths, strict=True)
        rows = [_row(workers, 100.0, rate, width) for workers, rate, width in rates]
        chosen, _, _ = recommend(rows, _s(10.5))
        top = max(rows, key=lambda r: r.training.median)
        picked = next(row for row in rows if row.setting == chosen)
        # never slower than the table's fastest beyond noise, never dearer than needed
        assert picked is top or within_noise(top.training, picked.training)
        cheaper = [r for r in rows if r.setting.num_workers < chosen.num_workers]
        assert not any(within_noise(top.training, r.training) for r in cheaper)


def test_bench_loader_script_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    argv = ["bench", "loader", "--script", f"{script}:factory", "--steps", "3"]
    argv += ["--warmup", "1", "--repeats", "2", "--max-workers", "1", "--json"]
    assert main([*argv, "--devices", "cpu"]) == 0  # left out, a machine with a GPU uses it
    report = json.loads(capsys.readouterr().out)
    settings = [(r["num_workers"], r["pin_memory"]) for r in report["rows"]]
    assert settings == [(0, False), (1, False)]  # steps on the CPU: pin_memory=False only
    assert "pin_memory" in report["notes"][0]
    for row in report["rows"]:
        assert row["loader_batches_per_second"]["count"] == 2
        assert row["training_batches_per_second"]["median"] > 0
    assert report["recommended"]["num_workers"] in (0, 1)
    # from memory: one window before each training window of every setting
    assert report["step_alone_batches_per_second"]["count"] == 4
    assert report["message"].startswith("use num_workers=")
    assert report["batch_size"] == 32 and report["source"] == "tiny"
    assert report["device"] == "cpu"


def test_bench_loader_recipe_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "loader", "--recipe", "linear", "--steps", "2", "--warmup", "0"]
    assert main([*argv, "--repeats", "1", "--max-workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "DataLoader settings for linear" in out and "use num_workers=0" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--devices", "cuda:0"], "no CUDA GPU"),
        (["--devices", "nonsense"], "is not a device"),
        (["--recipe", "digits", "--batch-size", "5000"], "larger than the 1437"),
        (["--script", "nope.py:factory"], "no file"),
    ],
)
def test_bench_loader_errors_are_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if message == "no CUDA GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert main(["bench", "loader", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
