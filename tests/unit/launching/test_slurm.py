"""SLURM's environment read and checked, scontrol's absence, and `paratrain slurm` (in this
process; 2 simulated SLURM "nodes" training ddp on `cpu` processes with a fake scontrol:
tests/test_resilience.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from paratrain.cli.main import main
from paratrain.launching import slurm
from paratrain.launching.agent import Nodes
from paratrain.utils.errors import UserError


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("single", ["single"]),
    ],
)
def test_host_lists_are_expanded(nodelist: str, hosts: list[str]) -> None:
    assert slurm.expand_hostlist(nodelist) == hosts


def test_bad_host_lists_and_task_counts_are_named() -> None:
    with pytest.raises(UserError, match="unclosed"):
        slurm.expand_hostlist("node[1-2")
    with pytest.raises(UserError, match="cannot read the range 'x'"):
        slurm.expand_hostlist("node[x]")
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def _step(**changes: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "PATH": "",  # no scontrol: the own parser
    }
    return {**env, **changes}


def test_a_task_of_a_job_step_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    tasks = slurm.from_env(_step())
    assert tasks is not None
    assert (tasks.procid, tasks.ntasks, tasks.localid, tasks.local_tasks) == (5, 8, 1, 4)
    assert tasks.endpoint == "gpu07:20077"  # the port: derived from the job id
    env = tasks.launcher_environment()
    assert env["RANK"] == "5" and env["LOCAL_WORLD_SIZE"] == "4" and env["MASTER_ADDR"] == "gpu07"
    assert slurm.from_env(_step(MASTER_PORT="1234")).port == 1234  # type: ignore[union-attr]
    assert slurm.from_env({k: v for k, v in _step().items() if k != "SLURM_STEP_ID"}) is None
    assert slurm.from_env(_step(RANK="0")) is None  # another launcher started it
    assert slurm.from_env(_step(PARATRAIN_SLURM="0")) is None
    for wrong, message in [
        ({"SLURM_PROCID": "8"}, "SLURM_PROCID 8 is not below SLURM_NTASKS 8"),
        ({"SLURM_JOB_NODELIST": "gpu07"}, "names 1 node(s), not 2"),
        ({"SLURM_TASKS_PER_NODE": "3(x2)"}, "does not add up to 8 task(s) on 2"),
        ({"SLURM_LOCALID": "4"}, "SLURM_LOCALID 4 are out of range"),
        ({"SLURM_NTASKS": ""}, "SLURM_NTASKS='' is not a count"),
    ]:
        with pytest.raises(UserError, match="SLURM") as caught:
            slurm.from_env(_step(**wrong))
        assert message in str(caught.value)


def test_one_task_per_node_or_per_process_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from paratrain.cli.commands.launch_options import slurm_nodes

    args = type("Args", (), {"nnodes": 1, "node_rank": 0, "rdzv_endpoint": None})()
    args.max_restarts, args.requeue = 0, False
    for key, value in _step(SLURM_TASKS_PER_NODE="1(x2)", SLURM_NTASKS="2").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    nodes, _ = slurm_nodes(args, 4)  # type: ignore[arg-type]
    assert nodes == Nodes(2, 1, "gpu07:20077", 0) and "RANK" not in os.environ
    with pytest.raises(UserError, match=r"--ntasks-per-node=3 .* or --ntasks-per-node=1"):
        monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
        monkeypatch.setenv("SLURM_NTASKS", "4")
        slurm_nodes(args, 3)  # type: ignore[arg-type]
    nodes, _ = slurm_nodes(args, 2)  # type: ignore[arg-type]
    assert not nodes.uses_agent and os.environ["RANK"] == "1" and os.environ["WORLD_SIZE"] == "4"


def test_requeue_without_scontrol_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    message = slurm.requeue("77")
    assert message.startswith("paratrain: error: --requeue: scontrol is not on PATH")
    assert "checkpoint is complete" in message and "\n" not in message
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert main(["train", "--strategy", "cpu", "--requeue"]) == 2


def test_paratrain_slurm_writes_an_sbatch_script(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "train.sbatch"
    argv = ["slurm", "--nodes", "2", "--gpus-per-node", "4", "--time", "04:00:00"]
    argv += ["-o", str(script), "--", "--recipe", "digits", "--out", "/shared/runs/d"]
    assert main(argv) == 0
    text = script.read_text()
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=04:00:00",
        "#SBATCH --signal=USR1@120",
        "#SBATCH --requeue",
        "srun paratrain train --strategy ddp --recipe digits --out /shared/runs/d --devices 4 "
        "--requeue",
    ]:
        assert line in text, text
    for bad, message in [
        (["--recipe", "digits"], "needs --out DIR"),
        (["--out", "x", "--overwrite"], "drop --overwrite"),
        (["--out", "x", "--bogus"], "unrecognized arguments: --bogus"),
    ]:
        capsys.readouterr()
        assert main(["slurm", "--nodes", "1", "--gpus-per-node", "1", "--", *bad]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("layout", "said"),
    [
        (["--replicate", "2"], ""),  # one copy per machine: only gradients cross
        (["--replicate", "4"], ""),  # two copies per machine
        (["--tp", "4"], ""),
        ([], "paratrain: note: --strategy fsdp shards over all 8 processes of 2 machines"),
        (["--replicate", "3"], "--replicate 3 does not divide the 8 processes"),
        (["--tp", "3"], "--tp 3 does not divide the 8 processes"),
        (["--tp", "8"], "a tensor-parallel group of 8 spans machines"),
    ],
)
def test_a_two_dimensional_job_is_checked_against_its_machines(
    layout: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 machines x 4 GPUs: a layout that does not divide the 8 processes is refused before
    a script is written; fsdp (or a tensor-parallel group) across machines gets a note."""
    argv = ["slurm", "--nodes", "2", "--gpus-per-node", "4", "--", "--strategy", "fsdp"]
    code = main([*argv, *layout, "--recipe", "tiny-gpt", "--out", "/shared/runs/t"])
    captured = capsys.readouterr()
    assert code == (2 if "does not divide" in said else 0), captured.err
    assert (said in captured.err) if said else captured.err == "", captured.err
    assert ("srun paratrain train" in captured.out) == (code == 0)


def test_a_copy_larger_than_one_machine_gets_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    """4 machines x 2 GPUs, a pipeline in 2 copies of 4 stages: each copy spans 2 machines."""
    argv = ["slurm", "--nodes", "4", "--gpus-per-node", "2", "--", "--strategy", "pipeline"]
    assert main([*argv, "--replicate", "2", "--recipe", "tiny-gpt", "--out", "/shared/t"]) == 0
    err = capsys.readouterr().err
    assert "each of the 2 copies (4 processes) spans machines" in err, err
    assert "--replicate 4 keeps each copy on one machine" in err
