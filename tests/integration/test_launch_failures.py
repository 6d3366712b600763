"""When a process of a multi-process run fails, is killed or never joins: the others stop,
the error names the rank and the cause, and no process is left behind. Bad input fails
before any process starts."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import CLI
from helpers.cli import start_paratrain
from helpers.processes import listening, parent_of, rank_processes

import paratrain
from paratrain.cli.main import main
from paratrain.utils.errors import LaunchError, UserError

pytestmark = pytest.mark.slow  # real processes, or several layers at work


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (Linux)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def spawned_workers(pid: int) -> list[int]:
    return rank_processes(pid)


def wait_for(condition: object, what: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.2)


# -- bad input: exit code 2 before any process exists ------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0"], "--devices 0 must be at least 1"),
        (["--devices", "-3"], "--devices -3 must be at least 1"),
        (
            ["--devices", "cpu,cpu,cpu", "--batch-size", "2"],
            "--batch-size 2 is smaller than the number",
        ),
        (["--devices", "cuda:95"], "cuda:95"),  # no machine has 96 GPUs
    ],
)
def test_bad_input_fails_before_any_process(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["train", "--strategy", "ddp", "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("paratrain: error: ") and message in err
    assert not (tmp_path / "run").exists()


def test_paratrain_run_checks_devices_before_starting(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "script.py"
    script.write_text("print('never runs')\n")
    assert main(["run", str(script), "--strategy", "ddp", "--devices", "0"]) == 2
    assert "--devices 0 must be at least 1" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_launch_needs_a_picklable_function() -> None:
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0)
    with pytest.raises(UserError, match="top level"):
        rt.launch(lambda rt: None)


# -- failures inside the processes ---------------------------------------------------------


def _rendezvous_seen(rt: paratrain.Runtime, launcher: int) -> tuple[int, list[tuple[str, int]]]:
    rt.barrier()  # joined
    return int(os.environ["MASTER_PORT"]), listening([launcher])


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc")
def test_the_launcher_holds_the_rendezvous_port_from_before_the_processes_start() -> None:
    """No port is picked free, closed, and bound later by rank 0: another run could take it
    in between (seen: EADDRINUSE in a busy test suite), and its processes meet this one's.
    The launcher listens on it before any process starts, and every rank connects."""
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0)
    port, listeners = rt.launch(_rendezvous_seen, os.getpid())
    assert ("127.0.0.1", port) in listeners


def _raise_on_rank_one(rt: paratrain.Runtime) -> None:
    rt.barrier()  # joined
    if rt.rank == 1:
        raise ValueError("boom on rank one")
    rt.barrier()  # rank 0 waits here until rank 1 is gone


@pytest.mark.timeout(90)  # a hang here is the bug under test
def test_an_exception_names_the_rank_and_its_traceback() -> None:
    with pytest.raises(LaunchError) as info:
        paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0).launch(_raise_on_rank_one)
    message = str(info.value)
    assert message.startswith("rank 1 (pid ")
    assert "Traceback (most recent call last)" in message
    assert "_raise_on_rank_one" in message
    assert "ValueError: boom on rank one" in message


def _hang_before_joining(rt: paratrain.Runtime, pid_dir: str) -> None:
    Path(pid_dir, f"rank-{rt.rank}.pid").write_text(str(os.getpid()))
    if rt.rank == 1:
        time.sleep(3600)  # never joins
    rt.barrier()


@pytest.mark.timeout(90)  # a hang here is the bug under test
def test_a_rank_that_never_joins_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PARATRAIN_INIT_TIMEOUT", "3")
    with pytest.raises(LaunchError) as info:
        paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0).launch(
            _hang_before_joining, str(tmp_path)
        )
    message = str(info.value)
    assert "did not all join the process group within 3s (PARATRAIN_INIT_TIMEOUT)" in message
    pids = [int(p.read_text()) for p in tmp_path.glob("rank-*.pid")]
    assert len(pids) == 2
    assert not any(running(pid) for pid in pids)


@pytest.mark.timeout(90)  # a hang here is the bug under test
def test_kill_9_of_one_worker_stops_the_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = ["train", "--strategy", "ddp"]
    command += ["--devices", "cpu,cpu", "--epochs", "100000", "--no-progress", "--out", str(out)]
    process = start_paratrain(*command)
    try:
        metrics = out / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, "epoch 0")
        workers = spawned_workers(process.pid)
        assert len(workers) == 2
        # the command forked them itself (paratrain.launching.rank_start), no fork server
        assert [parent_of(worker) for worker in workers] == [process.pid] * 2
        victim = workers[-1]
        os.kill(victim, signal.SIGKILL)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, err[-2000:]
    match = re.search(
        r"paratrain: error: rank (\d) \(pid (\d+)\) was killed by signal SIGKILL", err
    )
    assert match is not None, err[-2000:]
    assert int(match.group(2)) == victim
    assert "Traceback" not in err
    assert not any(running(pid) for pid in workers)


@pytest.mark.timeout(90)  # a hang here is the bug under test
def test_paratrain_run_reports_the_failed_rank(paratrain_cli: CLI, tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(
        "import atexit, pathlib\n"
        "import paratrain\n"
        "rt = paratrain.Runtime()\n"
        "here = pathlib.Path(__file__).parent\n"
        "atexit.register(lambda: (here / f'exit-handlers-r{rt.rank}').touch())\n"
        "class Finalized:\n"
        "    def __del__(self):\n"
        "        (here / f'finalized-r{rt.rank}').touch()\n"
        "left_to_finalization = Finalized()\n"
        "rt.barrier()\n"
        "if rt.rank == 1:\n"
        "    raise ValueError('boom on rank one')\n"
        "rt.barrier()\n"
    )
    result = paratrain_cli("run", str(script), "--strategy", "ddp", "--devices", "cpu,cpu")
    err = result.stderr
    assert result.returncode == 1
    assert f"paratrain: error: {script} failed" in err
    assert "rank 1's traceback:" in err and "ValueError: boom on rank one" in err
    root_cause = err.split("Root Cause", 1)[1]
    assert re.search(r"rank\s*:\s*1 ", root_cause), err[-3000:]
    # the failed rank ran the program's exit handlers, then left without the interpreter's
    # finalization, where gloo's threads may abort it ("terminate called ...") after the report
    assert (tmp_path / "exit-handlers-r1").exists()
    assert not (tmp_path / "finalized-r1").exists()
