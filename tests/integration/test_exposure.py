"""A running job, seen from outside: nothing it listens on is reachable from another
machine, its run directory is locked, and killing its launcher leaves no rank behind.
Real runs (`--strategy ddp --devices cpu,cpu`, spawned and under torchrun's agent) on gloo;
each is killed with SIGKILL once it has written a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import subprocess_env
from helpers.cli import start_paratrain
from helpers.processes import alive, descendants, exposed, is_rank_process, listening

from paratrain.cli.main import main
from paratrain.launching import heartbeat
from paratrain.training import run_lock
from paratrain.utils.errors import UserError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


def _until(condition, seconds: float = 120) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    run = tmp_path / "run"
    args = ["train", "--strategy", "ddp", "--devices", "cpu,cpu", "--epochs", "50"]
    args += ["--save-every", "1", "--out", str(run), "--no-progress", *extra]
    launcher = start_paratrain(*args, cwd=tmp_path, stderr=subprocess.STDOUT)
    checkpoints = run / "checkpoints"
    started = _until(
        lambda: (
            launcher.poll() is not None
            or (
                checkpoints.is_dir()
                and any(p.name.startswith("step-") for p in checkpoints.iterdir())
            )
        )
    )
    assert started and launcher.poll() is None, launcher.stdout.read() if launcher.stdout else ""
    return launcher, run


def _check_job(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> int:
    """Start a job; check its listeners and its lock; SIGKILL its launcher; check that no
    rank outlives it. Returns how many listeners it had."""
    launcher, run = _start(tmp_path, *extra)
    try:
        ranks = descendants(launcher.pid)
        listeners = listening([launcher.pid, *ranks])
        assert listeners, "the job listens on nothing: the check would prove nothing"
        assert exposed(listeners) == [], f"listening beyond loopback: {listeners}"
        # A second run on the same directory is refused while this one writes it.
        assert main(["train", "--resume", str(run)]) == 2
        assert "in use by another run" in capsys.readouterr().err
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        if launcher.stdout is not None:
            launcher.stdout.close()
    assert _until(lambda: not any(alive(pid) for pid in ranks), 30), [
        pid for pid in ranks if alive(pid)
    ]
    # The dead launcher's lock is stale: the next run takes it over, with a note.
    run_lock.acquire(run).release()
    assert "which is gone; taking the lock over" in capsys.readouterr().err
    return len(listeners)


def test_spawned_job_listens_on_loopback_and_dies_with_its_launcher(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # rank 0's store and both ranks' gloo sockets
    assert _check_job(tmp_path, capsys) >= 3


def test_agent_job_listens_on_loopback_and_dies_with_its_launcher(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the agent's rendezvous store and its workers' store, and gloo's sockets
    assert _check_job(tmp_path, capsys, "--max-restarts", "1") >= 4


def _lock_file(run: Path, owner: object) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / run_lock.LOCK).write_text(json.dumps(owner))


def test_a_live_or_remote_owner_keeps_its_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process: a live pid on this host, and any pid on another host, are refused
    (exit code 2, one line); an unreadable lock is stale; a released lock is gone."""
    run = tmp_path / "run"
    _lock_file(run, {"host": socket.gethostname(), "pid": os.getppid()})
    with pytest.raises(UserError, match=f"pid {os.getppid()} on this machine"):
        run_lock.acquire(run)
    assert main(["train", "--no-progress", "--strategy", "cpu", "--resume", str(run)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    _lock_file(run, {"host": "elsewhere", "pid": 1})
    with pytest.raises(UserError, match="locked by pid 1 on host elsewhere"):
        run_lock.acquire(run)
    (run / run_lock.LOCK).write_text("{half")
    with run_lock.hold(run):
        assert json.loads((run / run_lock.LOCK).read_text())["pid"] == os.getpid()
    assert not (run / run_lock.LOCK).exists()
    assert "taking the lock over" in capsys.readouterr().err


# The middle process starts a beating rank (no prctl: the fallback alone) and exits.
_ORPHAN = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import importlib.util, sys, time
# heartbeat.py alone, without importing paratrain (and torch): quick to start
spec = importlib.util.spec_from_file_location("heartbeat", sys.argv[1])
heartbeat = sys.modules["heartbeat"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heartbeat)
heartbeat.arm(0)
while True:
    heartbeat.beat()
    time.sleep(0.001)
''', sys.argv[1]])
beat = os.path.join(os.environ["PARATRAIN_HEARTBEAT_DIR"], "beat-rank0")
while not os.path.exists(beat) and child.poll() is None:
    pass  # once the rank knows its parent, leave it
print(child.pid, flush=True)
"""


def test_the_heartbeat_stops_a_rank_whose_launcher_is_gone(tmp_path: Path) -> None:
    """Where no kernel signal kills it (not Linux), a rank notices in its heartbeat."""
    env = subprocess_env(PARATRAIN_HEARTBEAT_DIR=str(tmp_path))
    middle = subprocess.run(
        [sys.executable, "-c", _ORPHAN, heartbeat.__file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    rank = int(middle.stdout.split()[0])
    assert _until(lambda: not alive(rank), 60), "the orphaned rank trains on"


# The middle process starts a child that, like every paratrain process, looks at its parent
# only once it has imported torch (the sleep), and exits at once itself.
_LATE_LOOK = """
import os, subprocess, sys
code = '''
import importlib.util, sys, time
time.sleep(1.5)  # importing torch
spec = importlib.util.spec_from_file_location("parent_death", sys.argv[1])
parent_death = importlib.util.module_from_spec(spec)
spec.loader.exec_module(parent_death)
parent_death.die_with_parent()
open(sys.argv[2], "w").write("trained on alone")
'''
env = dict(os.environ, PARATRAIN_PARENT_PID=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", code, *sys.argv[1:]], env=env)
print(child.pid, flush=True)
"""


def test_a_process_whose_launcher_died_while_it_started_does_not_run_on(tmp_path: Path) -> None:
    """By the time it looks, its parent is PID 1 (or a subreaper): the pid its launcher
    gave it says that is not the process that started it."""
    from paratrain.launching import parent_death

    marker = tmp_path / "survived"
    middle = subprocess.run(
        [sys.executable, "-c", _LATE_LOOK, parent_death.__file__, str(marker)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    child = int(middle.stdout.split()[0])
    assert _until(lambda: not alive(child), 60), "the orphan still runs"
    assert not marker.exists(), "the orphan ran on after its parent was gone"


def _carrying(marker: str) -> list[int]:
    """Processes of this machine whose environment holds ``marker`` (what a process and all
    it starts inherit)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_bench_stopped_while_its_ranks_start_leaves_no_process(tmp_path: Path) -> None:
    """SIGTERM to `paratrain bench` while a ddp worker's ranks import torch: the worker dies
    with the bench, and its ranks with it (they used to form their group alone and wait
    under PID 1 for requests that never came)."""
    marker = f"PARATRAIN_TEST_MARKER=bench-{os.getpid()}-{time.monotonic_ns()}"
    name, value = marker.split("=")
    argv = ["bench", "--strategies", "ddp", "--devices", "cpu,cpu", "--precisions", "32"]
    argv += ["--steps", "3", "--repeats", "3", "--instances", "1", "--no-plot"]
    bench = start_paratrain(
        *argv,
        "--out",
        str(tmp_path / "bench"),
        env=subprocess_env(**{name: value}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def ranks_starting() -> bool:
        for pid in _carrying(marker):
            if is_rank_process(pid):
                return True
        return bench.poll() is not None

    assert _until(ranks_starting, 120) and bench.poll() is None, "no rank ever started"
    bench.send_signal(signal.SIGTERM)
    bench.wait(timeout=60)
    assert _until(lambda: not _carrying(marker), 60), f"left behind: {_carrying(marker)}"
