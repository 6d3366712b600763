"""A stop signal in a run's first second, before its loop handles signals: one line saying
the run was stopped before its first step, by which signal, and exit 128 + the signal
(it used to be exit 143 and not a word). Devices: none (cpu)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import subprocess_env

pytestmark = pytest.mark.slow  # real processes, or several layers at work


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (its SigCgt mask, from /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & (1 << (signum - 1)))


@pytest.mark.parametrize("strategy", [["--strategy", "cpu"], ["--devices", "cpu,cpu"]])
def test_sigterm_in_the_first_second_says_so(tmp_path: Path, strategy: list[str]) -> None:
    command = [sys.executable, "-m", "paratrain", "train", "--recipe", "digits", *strategy]
    command += ["--max-steps", "5", "--no-progress", "--out", "run"]
    run = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # As soon as the command handles SIGTERM: long before its first step (torch is not
    # even imported yet). A command that never does by then is sent it all the same.
    deadline = time.monotonic() + 10.0
    while not _catches(run.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.005)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 143, err[-2000:]
    line = "paratrain: stopped by SIGTERM before the first step: nothing was saved"
    assert err.count(line) == 1, err[-2000:]
    assert "Traceback" not in err
