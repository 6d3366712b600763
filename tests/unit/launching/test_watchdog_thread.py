"""torchrun's agent watches its ranks from a thread: the watchdog's look kills the ranks, then
returns the hang. The agent may see its ranks dead before that look is back (a busy machine
leaves the thread waiting for a core); it must still name the stuck rank, not report that its
ranks were killed. Devices: none (no process is started)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from paratrain.launching.agent import AgentLauncher, Nodes
from paratrain.launching.watchdog import Hang, Watchdog, WatchdogThread
from paratrain.utils.errors import LaunchError
from paratrain.utils.reports import ReportFolder


class _SlowToReturn(Watchdog):
    """A watchdog whose first look finds a hang and is slow to return it after the kill."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, timeout=8.0)
        self.killed = threading.Event()
        self.found = Hang(1, 4242, 9.0, "the stack", "replicate 1, shard 0")

    def check(self) -> Hang | None:
        if self.killed.is_set():
            return None  # the ranks are gone: nothing more to find
        self.killed.set()  # what the agent sees first: its ranks died of SIGKILL
        time.sleep(0.5)  # this thread waits for a core before the hang is returned
        return self.found


def test_the_agent_names_the_hang_its_watchdog_is_still_returning(tmp_path: Path) -> None:
    launcher = AgentLauncher(Nodes(), 2, "paratrain train")
    launcher.reports = ReportFolder(tmp_path)  # no rank reported anything: they were killed
    watchdog = _SlowToReturn(tmp_path)
    with WatchdogThread(watchdog) as thread:
        assert watchdog.killed.wait(60)
        error = launcher._failure(RuntimeError("rank 1 received signal 9"), thread)
    assert isinstance(error, LaunchError)
    expected = "rank 1 (pid 4242; replicate 1, shard 0) made no progress for 9s"
    assert str(error).startswith(expected), str(error)
    assert "the stack" in str(error)


def test_a_failure_without_a_hang_is_the_agents_own(tmp_path: Path) -> None:
    launcher = AgentLauncher(Nodes(), 2, "paratrain train")
    launcher.reports = ReportFolder(tmp_path)
    watchdog = Watchdog(tmp_path, timeout=8.0)  # no heartbeat in the folder: nothing late
    with WatchdogThread(watchdog) as thread:
        error = launcher._failure(RuntimeError("rank 0 exited with code 3"), thread)
    assert str(error) == "paratrain train failed; the cause:\nrank 0 exited with code 3"
