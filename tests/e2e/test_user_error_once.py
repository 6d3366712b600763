"""A user's one-line error under torchrun is printed exactly once, also on a busy machine:
whichever process meets it first says it (rank 0 used to, and was often stopped by the
agent before it could), and a launcher never reads a rank's report half-written.
Devices: none (gloo-free: the error comes before any process group)."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import subprocess_env

from paratrain.utils.reports import ReportFolder

pytestmark = pytest.mark.slow  # real processes, or several layers at work

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
MESSAGE = "paratrain: error: unknown recipe 'nope'"
#: two gloo processes on the CPU, also where there are GPUs
CPU2 = ("--strategy", "ddp", "--devices", "cpu,cpu")

# rank 0 meets the bad input last, as on a busy machine: the others fail first
_LATE_RANK_0 = """
import os, sys, time
if os.environ["RANK"] == "0":
    time.sleep(6)
from paratrain.cli.main import main
sys.exit(main(["train", "--recipe", "nope", "--strategy", "ddp", "--devices", "cpu,cpu"]))
"""


@pytest.fixture
def busy() -> Iterator[None]:
    """A CPU-bound process beside the test, as on a shared CI runner."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _torchrun(tmp_path: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TORCHRUN, "2", "--monitor-interval", "0.1", *command],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_first_process_to_fail_says_it_when_rank_0_is_late(tmp_path: Path) -> None:
    (tmp_path / "late.py").write_text(_LATE_RANK_0)
    result = _torchrun(tmp_path, "late.py")
    assert result.returncode != 0
    assert result.stderr.count(MESSAGE) == 1, result.stderr[-3000:]


def test_user_error_under_plain_torchrun_on_a_busy_machine(tmp_path: Path, busy: None) -> None:
    result = _torchrun(tmp_path, "-m", "paratrain", "train", "--recipe", "nope", *CPU2)
    assert result.returncode != 0
    assert result.stderr.count(MESSAGE) == 1, result.stderr[-3000:]


_SCRIPT = """
import paratrain

def train(rt):
    raise paratrain.UserError("the data set is empty: nothing to train on")

if __name__ == "__main__":
    rt = paratrain.Runtime()
    rt.launch(train)
"""


def test_user_error_under_paratrain_run_on_a_busy_machine(tmp_path: Path, busy: None) -> None:
    (tmp_path / "script.py").write_text(_SCRIPT)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "paratrain",
            "run",
            "script.py",
            "--strategy",
            "ddp",
            "--devices",
            "cpu,cpu",
        ],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    line = "paratrain: error: the data set is empty: nothing to train on"
    assert result.stderr.count(line) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


# -- the report folder: a launcher reads while its ranks write ------------------------------


def _write_reports(directory: str, rank: int, attempts: int, message: str) -> None:
    reports = ReportFolder(directory)
    for attempt in range(attempts):
        reports.failed(attempt, rank, "user", message)


def test_a_report_is_never_read_half_written(tmp_path: Path) -> None:
    message = "the data set is empty: " + "x" * 4000
    context = mp.get_context("fork")  # the writers only write files: no torch in them
    writers = [
        context.Process(target=_write_reports, args=(str(tmp_path), rank, 400, message))
        for rank in range(2)
    ]
    for writer in writers:
        writer.start()
    reports, seen, wrong = ReportFolder(tmp_path), 0, []
    while any(writer.is_alive() for writer in writers) or not seen:
        failure = reports.first_one_line()
        if failure is not None:
            seen += 1
            if failure.message != message:
                wrong.append(len(failure.message))
    for writer in writers:
        writer.join()
    assert not wrong, f"{len(wrong)} of {seen} reads saw a partial report (lengths {wrong[:5]})"
