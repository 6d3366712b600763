"""Options of how processes start and are watched, shared by `paratrain train` and
`paratrain run`: several machines, restarts, the hang timeout and non-finite losses."""

from __future__ import annotations

import argparse
import os

from paratrain.agent import Nodes
from paratrain.nonfinite import POLICY_VARIABLE
from paratrain.watchdog import TIMEOUT_VARIABLE, hang_timeout

#: options that take a value, as `paratrain run` finds them among the script's arguments
VALUE_OPTIONS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts", "--hang-timeout")
FLAG_OPTIONS = ("--skip-nonfinite",)


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
    """The hang timeout and the non-finite policy reach every process as environment."""
    if args.hang_timeout is not None:
        os.environ[TIMEOUT_VARIABLE] = str(args.hang_timeout)
        hang_timeout()  # a bad value fails here, before anything starts
    if args.skip_nonfinite:
        os.environ[POLICY_VARIABLE] = "skip"
