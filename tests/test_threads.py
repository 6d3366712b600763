"""The intra-op threads paratrain chooses for its processes (``--strategy cpu`` and
``--devices cpu,cpu``): a pure choice, applied in this process, handed to spawned ones,
recorded in config.json."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import paratrain
from paratrain import threads
from paratrain.cli import main
from paratrain.errors import UserError
from paratrain.threads import ThreadChoice, choose_for, choose_threads


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    """A test that applies a choice in this process leaves the suite's one thread."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("cores", "processes", "busy", "expected"),
    [
        (2, 1, 0.0, 2),  # quiet: every core
        (2, 2, 0.0, 1),  # cores / processes
        (8, 3, 0.0, 2),  # never more than the share: 3 x 2 <= 8
        (1, 4, 0.0, 1),  # at least one
        (2, 1, 1.0, 1),  # one competing process: only the free core
        (2, 1, 5.0, 1),  # more busy than cores: still one
        (16, 2, 4.0, 6),  # 12 free cores over 2 processes
        (16, 2, 0.5, 7),  # a part-busy core is not free
    ],
)
def test_threads_are_the_free_cores_divided_by_the_processes(
    cores: int, processes: int, busy: float, expected: int
) -> None:
    choice = choose_threads(cores, processes, busy)
    assert choice.threads == expected
    assert choice.threads * processes <= max(cores, processes)
    assert (choice.source, choice.wait_policy) == ("chosen", "PASSIVE")
    assert f"{expected} thread(s)" in choice.reason


def test_an_explicit_count_wins_then_the_users_environment() -> None:
    assert choose_threads(2, 1, 0.0, requested=3).threads == 3
    assert choose_threads(2, 1, 0.0, requested=3, inherited="1").source == "threads"
    given = choose_threads(2, 1, 1.0, inherited="2")
    assert (given.threads, given.source) == (2, "OMP_NUM_THREADS")
    for junk in ("", "0", "two", "-1"):  # not a count: chosen as if unset
        assert choose_threads(2, 1, 1.0, inherited=junk).source == "chosen"


def test_the_choice_reaches_a_child_through_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    child = choose_threads(4, 2, 0.0).child_environment()
    assert child["OMP_NUM_THREADS"] == "2" and child["OMP_WAIT_POLICY"] == "PASSIVE"
    for name, value in child.items():
        monkeypatch.setenv(name, value)
    assert choose_for(2) == ThreadChoice(2, "PASSIVE", "chosen", choose_threads(4, 2, 0).reason)
    monkeypatch.delenv(threads.CHOSEN_VARIABLE)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's wait policy is kept
    assert choose_for(1).wait_policy == "ACTIVE"


def test_busy_cores_reads_the_machine() -> None:
    assert 0.0 <= threads.busy_cores(samples=2, interval=0.0) < 10_000
    assert threads.usable_cores() >= 1


def test_runtime_applies_records_and_checks_its_threads() -> None:
    rt = paratrain.Runtime(strategy="cpu", threads=2)
    assert torch.get_num_threads() == 2
    recorded = rt.describe()["threads"]
    assert (recorded["threads"], recorded["source"]) == (2, "threads")
    assert paratrain.Runtime.from_config(rt.config).threads.threads == 2
    with pytest.raises(UserError, match="threads must be at least 1"):
        paratrain.Runtime(strategy="cpu", threads=0)


def _threads_seen(rt: paratrain.Runtime) -> dict[str, Any]:
    return {
        "threads": torch.get_num_threads(),
        "policy": os.environ.get("OMP_WAIT_POLICY"),
        "recorded": rt.describe()["threads"],
    }


def test_spawned_processes_start_with_the_chosen_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    seen = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", threads=1).launch(_threads_seen)
    assert seen == {
        "threads": 1,
        "policy": "PASSIVE",  # set before the child imported torch
        "recorded": {
            "threads": 1,
            "wait_policy": "PASSIVE",
            "source": "threads",
            "reason": "1 as asked",
        },
    }
    # the launcher's own environment is as it was
    assert threads.CHOSEN_VARIABLE not in os.environ and "OMP_WAIT_POLICY" not in os.environ


def test_train_records_the_threads_in_config_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["train", "--strategy", "cpu", "--max-steps", "2", "--epochs", "1", "--no-progress"]
    assert main([*args, "--threads", "1", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["threads"] == 1
    assert config["runtime"]["threads"]["threads"] == 1
    assert config["runtime"]["threads"]["source"] == "threads"
    assert main([*args, "--threads", "0", "--out", str(tmp_path / "bad")]) == 2
    assert "--threads must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
