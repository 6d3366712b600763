"""What clusters do to runs: several machines, restarts, hangs, uneven work, non-finite
losses, and errors printed once. Real processes on gloo, each run bounded in time."""

from __future__ import annotations

import os
import random
import re
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CLI, subprocess_env
from helpers.cli import run_paratrain, start_paratrain
from safetensors.torch import load_file

from paratrain.cli.main import main
from paratrain.launching.launch import free_port

pytestmark = pytest.mark.slow  # real processes, or several layers at work


CPU2 = ["--strategy", "ddp", "--devices", "cpu,cpu"]
#: fsdp in two copies of one shard: a two-dimensional layout on two processes
HSDP_2X1 = ["--strategy", "fsdp", "--devices", "cpu,cpu", "--replicate", "2"]
#: one gloo process per "machine" where one host plays two (each would take cuda:0)
ONE_CPU = ["--devices", "cpu"]


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def paratrain(
    *args: str, cwd: Path, timeout: float = 240, **env: str
) -> subprocess.CompletedProcess[str]:
    return run_paratrain(*args, cwd=cwd, env=subprocess_env(**env), timeout=timeout)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


# A user's own loop: rank 1 misbehaves at step 7 as argv[1] says; every rank records the
# step it reached and its pid.
USER_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import paratrain

    mode = sys.argv[1]
    rt = paratrain.Runtime(strategy="auto", seed=0)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = TensorDataset(torch.randn(160, 4), torch.randn(160, 1))
    loader = rt.setup_loader(DataLoader(data, batch_size=8))
    for step, (x, y) in enumerate(loader, 1):
        Path(f"rank{rt.rank}").write_text(f"{os.getpid()} {step}")
        loss = nn.functional.mse_loss(model(x), y)
        if rt.rank == 1 and step == 7:
            if mode == "nan":
                loss = loss * float("nan")
            if mode == "sleep":
                time.sleep(3600)  # THE HANG
        rt.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    rt.print("finished", step)
    """
)


def ranks_reached(folder: Path) -> dict[int, tuple[int, int]]:
    """rank -> (pid, step reached), as the user script recorded them."""
    found = {}
    for path in folder.glob("rank*"):
        pid, step = path.read_text().split()
        found[int(path.name[4:])] = (int(pid), int(step))
    return found


# -- checked before anything starts --------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"], "between 0"),
        (["--rdzv-endpoint", "nowhere"], "must be HOST:PORT"),
        (["--max-restarts", "-1"], "--max-restarts must be 0 or more"),
        (["--hang-timeout", "-3"], "PARATRAIN_HANG_TIMEOUT='-3.0' (--hang-timeout)"),
        (
            [
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--rdzv-endpoint",
                "127.0.0.1:1",
                "--batch-size",
                "3",
            ],
            "--batch-size 3 is smaller than the number of processes (2 machine(s) x 2 = 4)",
        ),
    ],
)
def test_launch_options_are_checked_on_every_machine_before_starting(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    code = main(["train", *CPU2, "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("paratrain: error: ") and message in err, err
    assert err.count("\n") == 1
    assert not out.exists()


def test_user_errors_under_torchrun_are_printed_once(tmp_path: Path) -> None:
    result = run_paratrain(
        *("train", "--recipe", "nope", *CPU2),
        cwd=tmp_path,
        timeout=180,
        torchrun=("--standalone", "--nproc-per-node", "2"),
    )
    assert result.returncode != 0
    assert result.stderr.count("paratrain: error: unknown recipe 'nope'") == 1, result.stderr


# -- several machines ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_machines_train_to_the_weights_of_one_process(
    tmp_path: Path, digits_on_one_cpu: dict[str, torch.Tensor]
) -> None:
    steps = ["--max-steps", "50", "--no-progress"]
    endpoint = f"127.0.0.1:{free_port()}"
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    nodes = [
        start_paratrain(
            *("train", *CPU2, *steps, "--out", "two", "--nnodes", "2"),
            *("--node-rank", str(rank), "--rdzv-endpoint", endpoint),
            cwd=tmp_path,
            env=subprocess_env(TMPDIR=str(temporary)),
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:]
    stdout = outputs[0][0] + outputs[1][0]
    assert stdout.count("trained 1.1 epochs, 50 steps") == 1  # printed by rank 0 only
    one, two = digits_on_one_cpu, weights(tmp_path / "two")
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    print(f"\n2 machines x 2 gloo processes vs one process after 50 steps: max abs diff {diff:.3g}")
    assert diff < 1e-5
    assert _left_behind(temporary) == []


def _left_behind(temporary: Path) -> list[str]:
    """What the agents left in their temporary folder: nothing of their own, nor torch's
    ``torchelastic_*`` log folders (torch's compile cache may stay)."""
    return [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")]


# -- non-finite losses ---------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_nan_on_one_rank_stops_every_rank_at_that_step(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(USER_SCRIPT)
    result = paratrain("run", "script.py", "nan", *CPU2, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    message = "paratrain: error: the loss is NaN or infinite on rank 1 at step 7; every rank"
    assert result.stderr.count(message) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    # the ranks agree on the steps' checks about once a second (--agreement-seconds) and at
    # the epoch's end at the latest: every rank stops at the same step, naming step 7
    reached = {rank: step for rank, (_, step) in ranks_reached(tmp_path).items()}
    assert reached[0] == reached[1] and 7 < reached[0] <= 20, reached


@pytest.mark.timeout(240)
def test_skip_nonfinite_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    args = ["train", *CPU2, "--max-steps", "12", "--no-progress", "--skip-nonfinite"]
    result = paratrain(*args, "--out", "run", cwd=tmp_path, PARATRAIN_TEST_FAULT="nan:1:7")
    assert result.returncode == 0, result.stderr[-3000:]
    note = "the loss is NaN or infinite on rank 1 at step 7; every rank skipped it"
    assert result.stderr.count(note) == 1, result.stderr[-3000:]
    assert "trained 0.3 epochs, 12 steps" in result.stdout
    assert all(torch.isfinite(t).all() for t in weights(tmp_path / "run").values())
    assert "nan" not in (tmp_path / "run" / "metrics.jsonl").read_text().lower()


# -- hangs ---------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_sleeping_rank_of_a_users_script_is_named_with_its_stack(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(USER_SCRIPT)
    result = paratrain("run", "script.py", "sleep", *CPU2, "--hang-timeout", "4", cwd=tmp_path)
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    reached = ranks_reached(tmp_path)
    pid = reached[1][0]
    assert f"paratrain: error: rank 1 (pid {pid}) made no progress for " in err, err[-3000:]
    sleep_line = USER_SCRIPT.splitlines().index("            time.sleep(3600)  # THE HANG") + 1
    assert f'File "script.py", line {sleep_line} in <module>' in err, err[-3000:]
    assert not any(running(p) for p, _ in reached.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("launcher", "layout", "place"),
    [
        ((), CPU2, ""),
        (("--rdzv-endpoint",), HSDP_2X1, "; replicate 1, shard 0"),
    ],
    ids=["spawn", "agent"],
)
def test_paratrain_train_names_a_rank_stuck_in_python(
    tmp_path: Path, launcher: tuple[str, ...], layout: list[str], place: str
) -> None:
    """--hang-timeout reaches the watchdog of either launcher (rt.launch's, or torchrun's
    agent, which --rdzv-endpoint asks for as --max-restarts does) as a parameter; in a
    two-dimensional layout (HSDP of two copies of one shard) the report names the rank's
    coordinates."""
    args = ["train", *layout, "--max-steps", "40", "--no-progress", "--hang-timeout", "8"]
    if launcher:  # one attempt: a restart would only hang again
        args += [*launcher, f"127.0.0.1:{free_port()}"]
    result = paratrain(*args, "--out", "run", cwd=tmp_path, PARATRAIN_TEST_FAULT="stall:1:5")
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    stuck = rf"paratrain: error: rank 1 \(pid \d+{re.escape(place)}\) made no progress for \d+s"
    assert re.search(stuck, err), err
    if not launcher:  # rt.launch's report holds the whole stack (the agent's may be cut)
        assert "faults.py" in err and "in at_step" in err  # its stack: where it sleeps
        assert "loop.py" in err


# -- uneven work ---------------------------------------------------------------------------

UNEVEN_SCRIPT = textwrap.dedent(
    """
    import contextlib, sys
    import torch
    from torch import nn
    import paratrain

    rt = paratrain.Runtime(strategy="auto", seed=0)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = 8 if rt.rank == 0 else 5  # the user's own data: rank 1 has less
    data = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(batches)]
    with rt.join(model) if sys.argv[1] == "join" else contextlib.nullcontext():
        for x, y in data:
            rt.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    total = rt.all_reduce(torch.tensor([float(batches)]))
    rt.print("batches", int(total.item()))
    """
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["join", "plain"])
def test_ranks_with_different_numbers_of_batches(mode: str, tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(UNEVEN_SCRIPT)
    result = paratrain("run", "script.py", mode, *CPU2, "--hang-timeout", "30", cwd=tmp_path)
    if mode == "join":
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.count("batches 13") == 1
    else:
        assert result.returncode == 1, result.stderr[-3000:]
        # rank 1, out of data, is in rt.all_reduce while rank 0 still trains: both causes
        # that can bring that about are named (a rank guard, uneven data)
        assert "but another rank is still in a training step" in result.stderr, result.stderr[
            -3000:
        ]
        assert "ranks ran different numbers of batches" in result.stderr
        assert "made no progress" not in result.stderr  # failed at once, no hang


# -- elastic restarts ----------------------------------------------------------------------

RESTART_SETTINGS = [*CPU2, "--max-steps", "30", "--save-every", "5", "--batch-size", "64"]


FAKE_SCONTROL = """#!/bin/sh
echo "$@" >> "$SCONTROL_LOG"
if [ "$1" = show ]; then printf '127.0.0.1\\n127.0.0.2\\n'; fi
"""


def _together(commands: list[tuple[list[str], dict[str, str]]], cwd: Path) -> list[Any]:
    """Start every command at once (the processes of one run), wait for all."""
    started = [start_paratrain(*argv, cwd=cwd, env=env) for argv, env in commands]
    try:
        outputs = [process.communicate(timeout=300) for process in started]
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return [(p.returncode, out, err) for p, (out, err) in zip(started, outputs, strict=True)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_moved_between_schedulers_and_stopped_four_times_ends_bit_identical(
    tmp_path: Path, paratrain_here: CLI
) -> None:
    """ddp over 2 gloo processes, 30 steps. The reference: two Kubernetes "pods" with the
    environment a PyTorchJob sets. Then one run, always the same command on --out run:
    2 SLURM tasks on 2 "nodes" (127.0.0.[1-2]) stopped by SIGUSR1 on one rank and requeued
    with a fake scontrol; torchrun's agent (--max-restarts 1), a rank killed (one note, no
    tracebacks) and then SIGTERM; the agent again, Ctrl-C; plain processes to the end."""
    train = ["train", "--strategy", "ddp", "--max-steps", "30", "--save-every", "5"]
    train += ["--batch-size", "64", "--no-progress", "--out"]
    port = str(free_port())
    pods = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
    pods |= {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_MASTER_PORT": port}
    done = _together(
        [
            (
                [*train, "ref", "--devices", "cpu"],
                subprocess_env(**pods, RANK=str(r), PET_NODE_RANK=str(r)),
            )
            for r in (0, 1)
        ],
        tmp_path,
    )
    assert [code for code, _, _ in done] == [0, 0], done[0][2][-3000:]
    assert "trained 1.3 epochs, 30 steps" in done[0][1]

    k1, k2 = random.randint(1, 9), random.randint(13, 18)  # 10: the checkpoint restarted from
    k3 = random.randint(k2 + 2, 29)  # k2 + 1: rank 0 may still be loading the checkpoint
    print(f"\nstops after steps {k1} (SLURM), {k2} (agent), {k3} (agent, Ctrl-C)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    log = tmp_path / "scontrol.log"
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}
    slurm |= {"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_LOCALID": "0"}
    slurm |= {"SLURM_TASKS_PER_NODE": "1(x2)", "MASTER_PORT": str(free_port())}
    slurm |= {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SCONTROL_LOG": str(log)}
    slurm |= {"PARATRAIN_TEST_FAULT": f"sigusr1:1:{k1}"}
    tasks = [
        (
            [*train, "run", "--requeue", *ONE_CPU],
            subprocess_env(**slurm, SLURM_PROCID=str(r), SLURM_NODEID=str(r)),
        )
        for r in (0, 1)
    ]
    done = _together(tasks, tmp_path)
    err = done[0][2]
    assert [code for code, _, _ in done] == [138, 138], err[-3000:]
    stop = f"paratrain: stopped by SIGUSR1 after step {k1}: checkpoint run/checkpoints/step-"
    assert err.startswith(stop) and "paratrain: note: job 4242 requeued" in err, err
    assert err.count("\n") == 2 and done[1][2] == "", done[1][2]  # task 1 says nothing
    calls = log.read_text().splitlines()
    assert calls.count("requeue 4242") == 1 and "show hostnames 127.0.0.[1-2]" in calls

    agent = [*train, "run", "--devices", "cpu,cpu", "--max-restarts", "1"]
    faults = f"kill:1:12:1,launcher-sigterm:0:{k2}"
    result = paratrain(*agent, cwd=tmp_path, PARATRAIN_TEST_FAULT=faults)
    assert result.returncode == 143, result.stderr[-3000:]
    restart = "paratrain: note: rank 1 died (killed, or exited without an error); restart 1: "
    # step 10's checkpoint is written in the background: on a busy machine it may not be
    # complete when rank 1 dies at step 12, and the run continues from the one before it
    # (step 5's, or the SLURM stop's where that came later)
    continued = [
        restart + f"continuing from run/checkpoints/step-{step:06d}\n" for step in (10, max(5, k1))
    ]
    assert result.stdout.startswith(tuple(continued)), (result.stdout[:500], result.stderr[-2000:])
    assert f"paratrain: stopped by SIGTERM after step {k2}" in result.stderr
    assert result.stderr.count("\n") == 2, result.stderr  # the autoresume note and the stop
    result = paratrain(*agent, cwd=tmp_path, PARATRAIN_TEST_FAULT=f"launcher-sigint:1:{k3}")
    assert result.returncode == 130, result.stderr[-3000:]
    assert f"paratrain: stopped by SIGINT after step {k3}" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 2

    # the last leg in this process (its ranks start from the session's fork server)
    result = paratrain_here(*train, "run", "--devices", "cpu,cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"continuing from run/checkpoints/step-{k3:06d}" in result.stderr
    ref, run = weights(tmp_path / "ref"), weights(tmp_path / "run")
    assert all(torch.equal(ref[k], run[k]) for k in ref)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert metrics == (tmp_path / "ref" / "metrics.jsonl").read_text()


@pytest.mark.timeout(400)
def test_a_run_that_keeps_failing_stops_after_n_restarts(tmp_path: Path) -> None:
    args = ["train", *RESTART_SETTINGS, "--no-progress", "--max-restarts", "2", "--out", "run"]
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    result = paratrain(*args, cwd=tmp_path, PARATRAIN_TEST_FAULT="kill:1:2", TMPDIR=str(temporary))
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    assert "paratrain: error: paratrain train failed after 2 restart(s); the cause:" in err
    root_cause = err.split("Root Cause", 1)[1]
    assert re.search(r"rank\s*:\s*1 ", root_cause) and "SIGKILL" in root_cause, err[-3000:]
    assert err.count("paratrain: error:") == 1
    assert not os.path.exists(tmp_path / "run" / "model.safetensors")
    assert _left_behind(temporary) == []
