"""Processes started by SLURM's ``srun``: who is who, where the processes meet, requeueing.

Inside a job step (``SLURM_STEP_ID`` and ``SLURM_PROCID`` set, and no launcher's ``RANK``
already), :func:`from_env` reads ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
``SLURM_NODEID``, ``SLURM_NNODES``, ``SLURM_TASKS_PER_NODE`` and ``SLURM_JOB_NODELIST``
(expanded by ``scontrol show hostnames`` where it exists, else by :func:`expand_hostlist`)
and checks that they agree with each other. The processes meet on the first host of the
node list, at ``MASTER_PORT`` or a port derived from the job id (the same on every node).
``PARATRAIN_SLURM=0`` ignores SLURM's environment.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from paratrain.utils import environment
from paratrain.utils.errors import UserError

SWITCH_VARIABLE = "PARATRAIN_SLURM"
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: ``a[1,2],b`` -> ``["a[1,2]", "b"]``."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part for part in parts if part]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list, expanded: ``node[01-03,7],gpu[1-2]-ib`` ->
    node01, node02, node03, node7, gpu1-ib, gpu2-ib (zero padding kept; several bracket
    groups in one name multiply)."""
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        hosts += _expand_one(part, text)
    return hosts


def _expand_one(name: str, whole: str) -> list[str]:
    opening = name.find("[")
    if opening < 0:
        return [name]
    closing = name.find("]", opening)
    if closing < 0:
        raise UserError(f"SLURM node list {whole!r}: unclosed '[' in {name!r}")
    prefix, inside, rest = name[:opening], name[opening + 1 : closing], name[closing + 1 :]
    values: list[str] = []
    for item in inside.split(","):
        found = _RANGE.match(item.strip())
        if not found:
            raise UserError(f"SLURM node list {whole!r}: cannot read the range {item!r}")
        first, last = found.group(1), found.group(2) or found.group(1)
        width = len(first)
        values += [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    return [prefix + value + tail for value in values for tail in _expand_one(rest, whole)]


def hostnames(nodelist: str) -> list[str]:
    """The node list expanded by ``scontrol show hostnames`` where it exists."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        done = subprocess.run(
            [scontrol, "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    return expand_hostlist(nodelist)


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``, one count per node: ``2(x3),1`` -> 2, 2, 2, 1."""
    counts: list[int] = []
    for part in text.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not found:
            raise UserError(f"SLURM_TASKS_PER_NODE={text!r} cannot be read")
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    return counts


@dataclass(frozen=True)
class SlurmTasks:
    """This task of a SLURM job step, and the step's shape."""

    job_id: str
    procid: int
    ntasks: int
    localid: int
    nodeid: int
    hosts: tuple[str, ...]
    #: tasks on this task's node
    local_tasks: int
    port: int

    @property
    def endpoint(self) -> str:
        return f"{self.hosts[0]}:{self.port}"

    def launcher_environment(self) -> dict[str, str]:
        """One task per process: the environment torchrun would give this process."""
        return {
            "RANK": str(self.procid),
            "WORLD_SIZE": str(self.ntasks),
            "LOCAL_RANK": str(self.localid),
            "LOCAL_WORLD_SIZE": str(self.local_tasks),
            "GROUP_RANK": str(self.nodeid),
            "MASTER_ADDR": self.hosts[0],
            "MASTER_PORT": str(self.port),
        }


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "")
    if not raw.strip().isdigit():
        raise UserError(f"{name}={raw!r} is not a count: is this a SLURM job step (srun)?")
    return int(raw)


def from_env(env: Mapping[str, str] | None = None) -> SlurmTasks | None:
    """This task under ``srun``, checked; None outside a SLURM job step, under another
    launcher (``RANK`` set), or with ``PARATRAIN_SLURM=0``."""
    env = environment.current().variables if env is None else env
    if env.get(SWITCH_VARIABLE) == "0" or "RANK" in env:
        return None
    if env.get("SLURM_STEP_ID") is None or env.get("SLURM_PROCID") is None:
        return None
    procid, ntasks = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    localid, nodeid = _int(env, "SLURM_LOCALID"), _int(env, "SLURM_NODEID")
    nnodes = _int(env, "SLURM_NNODES")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = tuple(hostnames(nodelist)) if nodelist else ()
    per_node = tasks_per_node(env.get("SLURM_TASKS_PER_NODE") or f"{ntasks // max(nnodes, 1)}")
    problems = []
    if not procid < ntasks:
        problems.append(f"SLURM_PROCID {procid} is not below SLURM_NTASKS {ntasks}")
    if len(hosts) != nnodes:
        problems.append(f"the node list {nodelist!r} names {len(hosts)} node(s), not {nnodes}")
    if len(per_node) != nnodes or sum(per_node) != ntasks:
        problems.append(f"SLURM_TASKS_PER_NODE does not add up to {ntasks} task(s) on {nnodes}")
    elif not nodeid < nnodes or not localid < per_node[nodeid]:
        problems.append(f"SLURM_NODEID {nodeid} / SLURM_LOCALID {localid} are out of range")
    if problems:
        raise UserError(f"SLURM's environment does not add up: {'; '.join(problems)}")
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
    port = env.get("MASTER_PORT") or ""
    # the same on every node without talking: derived from the job id
    number = int(port) if port.isdigit() else 20000 + int(re.sub(r"\D", "", job_id) or 0) % 20000
    return SlurmTasks(job_id, procid, ntasks, localid, nodeid, hosts, per_node[nodeid], number)


def requeue(job_id: str) -> str:
    """``scontrol requeue JOB``; what happened, as one line."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return (
            "paratrain: error: --requeue: scontrol is not on PATH (inside a container?), so "
            f"job {job_id} was not requeued; its checkpoint is complete: submit the job "
            "again to continue"
        )
    done = subprocess.run(
        [scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().replace("\n", " ")
        return f"paratrain: error: scontrol requeue {job_id} failed ({why}); submit it again"
    return f"paratrain: note: job {job_id} requeued (scontrol requeue {job_id})"
