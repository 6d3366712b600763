"""Two processes that find the same stale run lock at once: one takes it over, the other
is refused (it used to be both). Devices: none (real processes, no torch)."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paratrain.training import run_lock
from paratrain.utils.errors import UserError

pytestmark = pytest.mark.slow  # real processes, or several layers at work

_TRIALS = 300


def _taker(dirs: list[Path], barrier: Any, won: Any, offset: int) -> None:
    sys.stderr = open("/dev/null", "w")  # noqa: SIM115  # the takeover notes
    for index, directory in enumerate(dirs):
        barrier.wait()
        try:
            run_lock.acquire(directory)  # held until this process ends
        except UserError:
            continue
        won[offset + index] = 1


def test_one_process_takes_over_a_stale_lock(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    stale = {"host": socket.gethostname(), "pid": int(gone.stdout), "since": 0.0}
    dirs = [tmp_path / f"run{i}" for i in range(_TRIALS)]
    for directory in dirs:
        directory.mkdir()
        (directory / run_lock.LOCK).write_text(json.dumps(stale))
    context = mp.get_context("fork")  # the takers only lock files: no torch in them
    barrier = context.Barrier(2)
    won = context.Array("b", 2 * _TRIALS)
    takers = [
        context.Process(target=_taker, args=(dirs, barrier, won, k * _TRIALS)) for k in range(2)
    ]
    for taker in takers:
        taker.start()
    for taker in takers:
        taker.join(300)
    assert [taker.exitcode for taker in takers] == [0, 0]
    owners = [won[i] + won[_TRIALS + i] for i in range(_TRIALS)]
    both = sum(count == 2 for count in owners)
    assert both == 0, f"both processes hold the lock in {both} of {_TRIALS} trials"
    assert all(count == 1 for count in owners), "a stale lock was taken over by nobody"
