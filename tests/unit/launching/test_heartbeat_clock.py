"""The hang watchdog's clock: a step of the wall clock (NTP on a cluster node) is neither a
hang nor hides one. Devices: none (heartbeat files in a folder, no process started)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from paratrain.launching import heartbeat
from paratrain.launching.watchdog import Watchdog


def _write_beat(directory: Path, seconds_ago: float) -> None:
    """Rank 0's heartbeat file, as a rank that last beat ``seconds_ago`` writes it."""
    when = time.monotonic() - seconds_ago
    heartbeat.beat_file(directory, 0).write_bytes(heartbeat.encode(os.getpid(), 5, when, 0))
    heartbeat.stack_file(directory, 0).write_text("Thread 0x1 (most recent call first):\n")


def _watched_here(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a rank a launcher watches through ``directory``, not yet armed."""
    monkeypatch.setenv(heartbeat.DIRECTORY_VARIABLE, str(directory))
    monkeypatch.setattr(heartbeat, "_heart", None)
    monkeypatch.setattr(heartbeat, "_checked", False)
    monkeypatch.setattr(heartbeat.faulthandler, "register", lambda *a, **k: None)


def test_a_rank_beats_on_the_machines_monotonic_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _watched_here(tmp_path, monkeypatch)
    before = time.monotonic()
    heartbeat.beat()
    [beat] = heartbeat.read_beats(tmp_path)
    assert beat.pid == os.getpid() and beat.count == 1
    assert before <= beat.time <= time.monotonic()


def test_a_wall_clock_step_is_no_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_beat(tmp_path, seconds_ago=1.0)
    stepped = time.time() + 3600.0  # the wall clock jumps an hour ahead
    monkeypatch.setattr(time, "time", lambda: stepped)
    assert Watchdog(tmp_path, timeout=60.0).check() is None


def test_silence_longer_than_the_timeout_is_still_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_beat(tmp_path, seconds_ago=120.0)
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)  # this test process is the "rank"
    stepped = time.time() - 3600.0  # and the wall clock stepped back an hour meanwhile
    monkeypatch.setattr(time, "time", lambda: stepped)
    hang = Watchdog(tmp_path, timeout=60.0).check()
    assert hang is not None and hang.rank == 0 and 119.0 <= hang.seconds < 130.0
    assert "most recent call first" in hang.stack


def test_a_hang_names_the_rank_by_its_place_in_a_two_dimensional_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank of a 2-D layout announces its coordinates; the report names them."""
    _watched_here(tmp_path, monkeypatch)
    heartbeat.announce_place("replicate 1, stage 0")  # before the first beat: not watched yet
    assert not heartbeat.place_file(tmp_path, 0).exists()
    heartbeat.beat()
    heartbeat.announce_place("replicate 1, stage 0")
    _write_beat(tmp_path, seconds_ago=120.0)
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)
    hang = Watchdog(tmp_path, timeout=60.0).check()
    assert hang is not None and hang.place == "replicate 1, stage 0"
    assert f"rank 0 (pid {os.getpid()}; replicate 1, stage 0) made no progress" in hang.message()
