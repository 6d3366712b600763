"""Options of how processes start and are watched, shared by `paratrain train` and
`paratrain run`: several machines, restarts, the hang timeout and non-finite losses."""

from __future__ import annotations

import argparse
import sys

from paratrain.launching import slurm
from paratrain.launching.agent import Nodes
from paratrain.launching.preemption import Stopped
from paratrain.launching.slurm import SlurmTasks
from paratrain.launching.watchdog import TIMEOUT_VARIABLE, hang_timeout
from paratrain.utils import environment
from paratrain.utils.errors import UserError

#: options that take a value, as `paratrain run` finds them among the script's arguments
VALUE_OPTIONS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts", "--hang-timeout")
FLAG_OPTIONS = ("--skip-nonfinite", "--requeue")


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, default=1, help="machines in the run (1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's number, 0..nnodes-1")
    p.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="where the machines meet (node 0's address); default 127.0.0.1, one machine",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart the processes up to N times after a failure (torchrun's elastic agent)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        metavar="S",
        help="stop the run when a process makes no progress for S seconds (600; 0: off)",
    )
    p.add_argument(
        "--requeue",
        action="store_true",
        help="under SLURM: on SIGUSR1 (sbatch --signal=USR1@120) checkpoint, stop and "
        "`scontrol requeue` the job, which then continues",
    )
    p.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip steps whose loss is NaN or infinite on any process, instead of stopping",
    )


def nodes_from_args(args: argparse.Namespace) -> Nodes:
    return Nodes(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
    ).check()


def apply_to_environment(args: argparse.Namespace) -> None:
    """`paratrain run`: the hang timeout and the non-finite policy reach the script's
    processes as environment, where the runtime the script builds reads them
    (`paratrain train` passes them as options of its configuration)."""
    from paratrain.runtime.config import NONFINITE_VARIABLE

    if args.hang_timeout is not None:
        environment.export({TIMEOUT_VARIABLE: str(args.hang_timeout)})
        hang_timeout()  # a bad value fails here, before anything starts
    if args.skip_nonfinite:
        environment.export({NONFINITE_VARIABLE: "skip"})


def slurm_nodes(args: argparse.Namespace, processes: int) -> tuple[Nodes, SlurmTasks | None]:
    """The machines of the run, from SLURM's environment under ``srun`` (``processes``: how
    many the strategy starts per node), else from the options. One task per process: this
    process is one rank (its launcher environment is set here); one task per node:
    torchrun's agent starts ``processes`` on each node, meeting on the first node."""
    if args.requeue and not environment.current().slurm_job_id:
        raise UserError("--requeue requeues a SLURM job, and SLURM_JOB_ID is not set")
    tasks = slurm.from_env()
    if tasks is None:
        return nodes_from_args(args), None
    if args.nnodes != 1 or args.node_rank != 0 or args.rdzv_endpoint is not None:
        raise UserError(
            "under srun, SLURM's environment says which nodes take part: drop --nnodes, "
            "--node-rank and --rdzv-endpoint (or set PARATRAIN_SLURM=0 to ignore SLURM)"
        )
    if tasks.local_tasks == processes:  # one task per process (per device)
        if args.max_restarts:
            raise UserError(
                "--max-restarts restarts the processes paratrain starts: run one task per "
                "node (srun --ntasks-per-node=1), not one per process"
            )
        environment.export(tasks.launcher_environment())
        return Nodes().check(), tasks
    if tasks.local_tasks == 1:  # one task per node: paratrain starts the processes
        nodes = Nodes(len(tasks.hosts), tasks.nodeid, tasks.endpoint, args.max_restarts)
        return nodes.check(), tasks
    raise UserError(
        f"SLURM started {tasks.local_tasks} task(s) on node {tasks.hosts[tasks.nodeid]} but "
        f"--strategy/--devices make {processes} process(es) per node: run srun with "
        f"--ntasks-per-node={processes} (one task per process) or --ntasks-per-node=1 "
        f"(paratrain starts {processes} per node)"
    )


def requeue_on_stop(args: argparse.Namespace, tasks: SlurmTasks | None, stop: Stopped) -> None:
    """``--requeue``: after a stop on SIGUSR1, the first task requeues the job."""
    if not args.requeue or stop.request.name != "SIGUSR1":
        return
    if tasks is not None and tasks.procid != 0:
        return
    job_id = tasks.job_id if tasks is not None else environment.current().slurm_job_id
    print(slurm.requeue(job_id), file=sys.stderr, flush=True)
