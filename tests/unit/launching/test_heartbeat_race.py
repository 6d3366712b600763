"""The hang watchdog reads each rank's heartbeat while the rank rewrites it: a record caught
half-written is never a beat at time 0 (silence since the machine booted), which killed
healthy ranks. Devices: none (a beating process, no torch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.launching import heartbeat
from paratrain.launching.watchdog import Watchdog

pytestmark = pytest.mark.slow  # real processes racing

# heartbeat.py alone, beating as fast as it can: the writer side of the race
_WRITER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("heartbeat", sys.argv[1])
heartbeat = sys.modules["heartbeat"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heartbeat)
heartbeat.arm(0)
while True:
    heartbeat.beat()
"""


def test_a_beat_read_while_it_is_written_is_whole(tmp_path: Path) -> None:
    env = {**os.environ, heartbeat.DIRECTORY_VARIABLE: str(tmp_path)}
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, heartbeat.__file__], env=env, start_new_session=True
    )
    try:
        started = time.monotonic()
        while not heartbeat.beat_file(tmp_path, 0).exists():
            assert writer.poll() is None, "the writer died"
            time.sleep(0.01)
        torn, reads, last = [], 0, 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and len(torn) < 5:
            for beat in heartbeat.read_beats(tmp_path):
                reads += 1
                if beat.pid != writer.pid or beat.time < started or beat.count < last:
                    torn.append(beat)
                last = max(last, beat.count)
        assert writer.poll() is None, "the writer died"
        assert not torn, f"{len(torn)} torn read(s) in {reads}: {torn[:3]}"
        assert last > 0
        # and the watchdog itself, racing the same writer, sees a healthy rank
        watchdog = Watchdog(tmp_path, timeout=30.0)
        assert all(watchdog.check() is None for _ in range(2000))
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait()
