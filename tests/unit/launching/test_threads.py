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
from paratrain_test_faults import BUSY_VARIABLE

import paratrain
from paratrain.cli.main import main
from paratrain.launching import threads, wait_policy
from paratrain.launching.threads import ThreadChoice, choose_for, choose_threads
from paratrain.utils.errors import UserError


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    """A test that applies a choice in this process leaves the suite's one thread."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def keep_torch_numerics() -> Iterator[None]:
    """``--deterministic`` in this process changes torch's global settings for good
    (deterministic algorithms, cuDNN's, TF32's): put back, or every later test of this
    process runs under them (on a GPU, each CUDA matmul then needs the CUBLAS_WORKSPACE_CONFIG
    that the suite's clean environment takes away, and reading the legacy TF32 flags
    raises). The TF32 flags are read through the API that determinism.py sets them with."""
    cudnn: Any = torch.backends.cudnn  # flags the type stubs do not declare
    matmul: Any = torch.backends.cuda.matmul
    if hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        flags = [(matmul, "fp32_precision"), (cudnn.conv, "fp32_precision")]
        flags += [(cudnn.rnn, "fp32_precision")]
    else:
        flags = [(matmul, "allow_tf32"), (cudnn, "allow_tf32")]
    flags += [(cudnn, "deterministic"), (cudnn, "benchmark")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in flags]
    algorithms = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
    for owner, name, value in saved:
        setattr(owner, name, value)


@pytest.mark.parametrize(
    ("cores", "processes", "expected"),
    [
        (2, 1, 2),  # every core
        (2, 2, 1),  # cores / processes
        (8, 3, 2),  # never more than the share: 3 x 2 <= 8
        (1, 4, 1),  # at least one
        (16, 2, 8),
    ],
)
def test_threads_are_the_cores_divided_by_the_processes(
    cores: int, processes: int, expected: int
) -> None:
    choice = choose_threads(cores, processes)
    assert choice.threads == expected
    assert choice.threads * processes <= max(cores, processes)
    assert (choice.source, choice.wait_policy) == ("chosen", "PASSIVE")
    assert f"{expected} thread(s)" in choice.reason


@pytest.mark.parametrize(
    ("cores", "processes", "busy", "expected"),
    [
        (2, 1, 0.0, 2),
        (2, 1, 0.9, 2),  # whole cores: a core is busy from 1.0
        (2, 1, 1.0, 1),  # one free core: one thread alone on it
        (2, 1, 5.0, 1),  # at least one
        (4, 2, 1.0, 1),  # 3 free cores / 2 processes
        (16, 2, 2.0, 7),
    ],
)
def test_the_count_leaves_busy_cores_to_other_work(
    cores: int, processes: int, busy: float, expected: int
) -> None:
    choice = choose_threads(cores, processes, busy=busy)
    assert (choice.threads, choice.source) == (expected, "chosen")
    assert ("busy with other work" in choice.reason) is (busy >= 1.0)
    assert choose_threads(cores, processes, requested=3, busy=busy).threads == 3
    assert choose_threads(cores, processes, inherited="3", busy=busy).threads == 3


def test_the_load_is_looked_at_unless_the_count_is_pinned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OMP_NUM_THREADS", threads.CHOSEN_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setenv(BUSY_VARIABLE, "2")
    assert choose_for(1).threads == 2
    assert choose_for(1, follow_load=False).threads == 4  # --deterministic
    note = threads.load_note(choose_for(1), 1)
    assert note is not None and "2 intra-op thread(s) per process instead of 4" in note
    monkeypatch.setenv(BUSY_VARIABLE, "0")
    assert choose_for(1).threads == 4 and threads.load_note(choose_for(1), 1) is None
    monkeypatch.delenv(BUSY_VARIABLE)
    monkeypatch.setattr(wait_policy, "busy_cores", lambda *_, **__: 3.0)  # the real look
    assert choose_for(2).threads == 1


def test_an_explicit_count_wins_then_the_users_environment() -> None:
    assert choose_threads(2, 1, requested=3).threads == 3
    assert choose_threads(2, 1, requested=3, inherited="1").source == "threads"
    given = choose_threads(2, 1, inherited="1")
    assert (given.threads, given.source) == (1, "OMP_NUM_THREADS")
    for junk in ("", "0", "two", "-1"):  # not a count: chosen as if unset
        assert choose_threads(2, 1, inherited=junk).source == "chosen"


def test_the_choice_reaches_a_child_through_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    child = choose_threads(4, 2).child_environment()
    assert child["OMP_NUM_THREADS"] == "2" and child["OMP_WAIT_POLICY"] == "PASSIVE"
    for name, value in child.items():
        monkeypatch.setenv(name, value)
    assert choose_for(2) == ThreadChoice(2, "PASSIVE", "chosen", choose_threads(4, 2).reason)
    monkeypatch.delenv(threads.CHOSEN_VARIABLE)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's wait policy is kept
    assert choose_for(1).wait_policy == "ACTIVE"


def test_busy_cores_reads_the_machine() -> None:
    assert 0.0 <= wait_policy.busy_cores(samples=2, interval=0.0) < 10_000
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


@pytest.mark.slow
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


def _train(out: Path, steps: int, *extra: str) -> dict[str, Any]:
    argv = ["train", "--strategy", "cpu", "--epochs", "1", "--max-steps", str(steps)]
    assert main([*argv, "--no-progress", "--out", str(out), *extra]) == 0
    return dict(json.loads((out / "config.json").read_text())["runtime"]["threads"])


@pytest.mark.slow
def test_a_busy_machine_gets_fewer_threads_recorded_and_kept_on_resume(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    keep_torch_numerics: None,
) -> None:
    """``--strategy cpu`` on 2 cores (simulated, as is the load). A run started beside other
    work takes the free core alone (one thread), says so once and records it; resumed on a
    quiet machine it keeps its one thread, bit for bit the run it continues. Work that
    starts during a run is said once and changes nothing. ``--deterministic`` keeps the
    quiet machine's count whatever the load."""
    for name in ("OMP_NUM_THREADS", threads.CHOSEN_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    quiet = _train(tmp_path / "quiet", 6)
    assert (quiet["threads"], quiet["source"]) == (2, "chosen")
    assert "instead of" not in capsys.readouterr().err

    monkeypatch.setenv(BUSY_VARIABLE, "1")
    busy = _train(tmp_path / "busy", 6)
    assert busy["threads"] == 1 and "1 busy with other work" in busy["reason"]
    note = capsys.readouterr().err
    assert note.count("1 intra-op thread(s) per process instead of 2") == 1, note
    pinned = _train(tmp_path / "pinned", 6, "--deterministic")
    assert pinned["threads"] == 2
    assert (tmp_path / "pinned" / "model.safetensors").read_bytes() == (
        tmp_path / "quiet" / "model.safetensors"
    ).read_bytes()

    _train(tmp_path / "resumed", 3)  # still busy: one thread, recorded
    monkeypatch.setenv(BUSY_VARIABLE, "0")  # quiet again for the resume
    waited = iter(range(0, 10_000, 10))  # ... until other work takes the cores mid-run
    monkeypatch.setattr(threads, "run_delay_seconds", lambda: float(next(waited)))
    monkeypatch.setattr(threads.ContentionGuard, "INTERVAL", 0.0)
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "resumed"), "--max-steps", "6"]) == 0
    config = json.loads((tmp_path / "resumed" / "config.json").read_text())
    assert config["runtime"]["threads"]["threads"] == 1 and config["config"]["threads"] == 1
    assert (tmp_path / "resumed" / "model.safetensors").read_bytes() == (
        tmp_path / "busy" / "model.safetensors"
    ).read_bytes()
    assert capsys.readouterr().err.count("cores busy") == 0  # one thread: nothing to wait on

    monkeypatch.setattr(threads, "run_delay_seconds", lambda: float(next(waited)))
    _train(tmp_path / "later", 6)
    later = capsys.readouterr().err
    assert later.count("since this run started: it keeps its 2 intra-op threads") == 1, later


@pytest.mark.slow
def test_the_command_waits_passively_on_a_busy_machine_a_script_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`python -m paratrain` and the `paratrain` script get OMP_WAIT_POLICY=PASSIVE before
    torch is imported (OpenMP reads it then) where other work keeps a core busy, and
    OpenMP's default (spinning: fastest) on a quiet machine; a script keeps its own."""
    import subprocess
    import sys

    from conftest import subprocess_env

    for argv0, command in (("-m", True), ("/usr/bin/paratrain", True), ("train.py", False)):
        monkeypatch.setattr(sys, "argv", [argv0])
        assert wait_policy.is_the_command() is command
    assert [wait_policy.policy_for(b) for b in (0.0, 0.9, 1.0, 3.0)] == [
        None, None, "PASSIVE", "PASSIVE"
    ]  # fmt: skip
    code = "import os, sys; sys.argv[0] = '{argv0}'; import paratrain; "
    code += "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    env = {k: v for k, v in subprocess_env().items() if k != "OMP_WAIT_POLICY"}
    seen = {}
    for argv0, busy in (("-m", "1"), ("-m", "0"), ("train.py", "1")):
        env[BUSY_VARIABLE] = busy
        done = subprocess.run(
            [sys.executable, "-c", code.format(argv0=argv0)],
            env=env,
            capture_output=True,
            text=True,
        )
        seen[(argv0, busy)] = done.stdout.split()
    # set when paratrain is imported, and torch is not imported with it: in place before
    assert seen == {
        ("-m", "1"): ["PASSIVE", "False"],
        ("-m", "0"): ["None", "False"],
        ("train.py", "1"): ["None", "False"],
    }
