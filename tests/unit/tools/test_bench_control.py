"""How the bench's runner and its workers wait for each other: asleep on a doorbell, so a
window is timed while every other process of the bench sleeps (bench/control.py).

Devices: the CPU only (one real worker process).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from paratrain.tools.bench import control
from paratrain.tools.bench.process import WorkerProcess
from paratrain.tools.bench.task import TaskSource
from paratrain.tools.bench.worker import RunSpec

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc for the context switches"
)
#: far longer than any wake-up takes; a wait that returns before it was woken
LONG = 30.0


def test_a_ring_wakes_the_waiter(tmp_path: Path) -> None:
    bell = control.Doorbell(tmp_path / "bell")
    ringer = threading.Timer(0.2, control.ring, args=(tmp_path / "bell",))
    ringer.start()
    begin = time.perf_counter()
    bell.wait(LONG)
    assert time.perf_counter() - begin < LONG / 2
    ringer.join()
    bell.close()


def test_a_ring_before_the_wait_is_not_lost(tmp_path: Path) -> None:
    bell = control.Doorbell(tmp_path / "bell")
    control.ring(tmp_path / "bell")
    control.ring(tmp_path / "bell")
    begin = time.perf_counter()
    bell.wait(LONG)
    assert time.perf_counter() - begin < LONG / 2
    # both rings were read at once: the next wait sleeps its whole time
    begin = time.perf_counter()
    bell.wait(0.2)
    assert time.perf_counter() - begin >= 0.15
    bell.close()


def test_ringing_nobody_is_harmless(tmp_path: Path) -> None:
    control.ring(tmp_path / "no-such-bell")  # a worker that never made one
    bell = control.Doorbell(tmp_path / "bell")
    bell.close()
    control.ring(tmp_path / "bell")  # a worker that is gone: nobody holds it open


def _voluntary_switches(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/status has no voluntary_ctxt_switches")


@linux_only
@pytest.mark.slow
def test_a_waiting_worker_sleeps_until_asked(tmp_path: Path) -> None:
    """Between its windows a worker wakes about once a second (to beat), not 100 times."""
    spec = RunSpec(TaskSource(recipe="linear"), "cpu", None, "32", 8, 3, 1, 1, threads=1)
    worker = WorkerProcess(spec, processes=1, timeout=120)
    try:
        assert worker.wait_ready(), worker.failed
        pid = worker._proc.pid  # one process: the worker is the rank that waits
        before = _voluntary_switches(pid)
        time.sleep(2.0)
        woken = _voluntary_switches(pid) - before
        assert woken <= 2.0 / control.WAKE_SECONDS + 3, f"{woken} wake-ups in 2 s"
        seconds = worker.window()  # and a request still wakes it at once
        assert seconds is not None and seconds > 0
    finally:
        result = worker.finish()
    assert result["status"] == "ok" and len(result["seconds"]) == 1


def test_without_fifos_waiting_falls_back_to_looking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the OS (or the file system of the temporary folder) has no FIFOs, a waiting
    process looks for its request every POLL_SECONDS instead: slower to react, same result."""
    monkeypatch.delattr(control.os, "mkfifo")
    requests = control.Requests(tmp_path, rank=0)
    assert not control.bell_path(tmp_path, 0).exists()
    begin = time.perf_counter()
    requests.bell.wait(LONG)  # nothing to block on: one look's sleep
    assert time.perf_counter() - begin < LONG / 2
    asker = threading.Timer(0.1, control.ask_window, args=(tmp_path, 0, 1))
    asker.start()
    assert requests.next(0)  # found by looking
    asker.join()
    control.ask_stop(tmp_path, 1)
    assert not requests.next(1)
