"""`paratrain slurm --nodes N --gpus-per-node G [...] -- TRAIN OPTIONS`: a ready sbatch script.

The script asks SLURM for one task per node; on each node `paratrain train` starts one
process per GPU (torchrun's agent), and the nodes meet on the first one (see
:mod:`paratrain.launching.slurm`). 120 s (``--signal-seconds``) before the time limit SLURM sends
SIGUSR1: every process finishes its step, the run saves a checkpoint, and `--requeue` puts
the job back in the queue; the requeued job runs the same command, which continues the run
in `--out` (autoresume).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, NoReturn

from paratrain.cli.commands import train
from paratrain.cli.commands.options import hidden_alias
from paratrain.distributed.mesh import mesh_shape
from paratrain.utils.errors import UserError

#: train options the script sets itself, or that would undo a requeue
_OWN = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--requeue")
_FORBIDDEN = ("--overwrite", "--fresh", "--resume")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "slurm",
        help="write an sbatch script that trains on SLURM, checkpoints before the time "
        "limit and requeues itself",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, required=True, help="machines (sbatch --nodes)")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs on each machine")
    p.add_argument("--time", help="time limit, e.g. 04:00:00 (sbatch --time)")
    p.add_argument("--partition", help="sbatch --partition")
    p.add_argument("--account", help="sbatch --account")
    p.add_argument("--job-name", default="paratrain", help="sbatch --job-name (paratrain)")
    p.add_argument("--cpus-per-task", type=int, help="CPU cores for each node's task")
    p.add_argument(
        "--signal-seconds",
        type=int,
        default=120,
        metavar="S",
        help="SIGUSR1 this long before the time limit: time for one step and a checkpoint",
    )
    p.add_argument(
        "--out",
        "-o",
        dest="output",
        metavar="FILE",
        help="write the script here (default: print it); the run's own --out goes after --",
    )
    hidden_alias(p, "--output", dest="output")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="options of paratrain train")
    p.set_defaults(handler=run)


def script(args: argparse.Namespace, train_args: list[str]) -> str:
    """The sbatch script's text."""
    lines = [
        "#!/bin/bash",
        f"# written by: paratrain slurm {shlex.join(_own_argv(args))}",
        f"#SBATCH --job-name={args.job_name}",
        f"#SBATCH --nodes={args.nodes}",
        "#SBATCH --ntasks-per-node=1            # paratrain starts one process per GPU",
        f"#SBATCH --gpus-per-node={args.gpus_per_node}",
    ]
    if args.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={args.cpus_per_task}")
    for name in ("time", "partition", "account"):
        if getattr(args, name):
            lines.append(f"#SBATCH --{name}={getattr(args, name)}")
    lines += [
        f"#SBATCH --signal=USR1@{args.signal_seconds}             # then: finish the step, "
        "checkpoint, requeue",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append             # a requeued job appends to the same log",
        "#SBATCH --output=slurm-%x-%j.out",
        "",
        "srun paratrain train " + shlex.join(train_args),
        "",
    ]
    return "\n".join(lines)


def _own_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node)]
    return [*argv, "--", *(a for a in args.train_args if a != "--")]


def _train_args(args: argparse.Namespace) -> list[str]:
    given = [a for a in args.train_args if a != "--"]
    flags = {a.split("=", 1)[0] for a in given}
    for name in _OWN + _FORBIDDEN:
        if name in flags:
            why = "the script sets it" if name in _OWN else "every requeue would start over"
            raise UserError(f"paratrain slurm: drop {name} from the train options ({why})")
    if "--out" not in flags:
        raise UserError(
            "paratrain slurm needs --out DIR on a filesystem every node shares: the "
            "requeued job continues the run there"
        )
    if "--strategy" not in flags:
        given = ["--strategy", "ddp", *given]
    if "--devices" not in flags:
        given = [*given, "--devices", str(args.gpus_per_node)]
    return [*given, "--requeue"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UserError(f"paratrain slurm: the train options: {message}")


def _check_train_options(train_args: list[str]) -> argparse.Namespace:
    """The options must make a valid `paratrain train` command: its own parser reads them."""
    parser = _Parser(prog="paratrain")
    train.register(parser.add_subparsers(parser_class=_Parser))
    return parser.parse_args(["train", *train_args])


def _gathers_shards(strategy: str) -> bool:
    """Whether ``strategy`` gathers parameter shards every step (``auto``, or a name `paratrain
    train` will refuse on the cluster: no)."""
    from paratrain.strategies.registry import strategy_class

    try:
        return strategy_class(strategy).gathers_shards
    except UserError:
        return False


def _check_mesh(args: argparse.Namespace, options: argparse.Namespace) -> None:
    """A two-dimensional layout must divide the job's processes; where a copy (HSDP, a
    pipeline in copies) or a tensor-parallel group would span machines, a note says so:
    its traffic, every step or every layer, would then cross the network."""
    from paratrain.devices.machine import parse_count, parse_device_list

    replicate, tp = getattr(options, "replicate", 1) or 1, getattr(options, "tp", 1) or 1
    spec = str(options.devices)
    per_node = parse_count(spec) or len(parse_device_list(spec))
    processes = args.nodes * per_node
    try:
        mesh_shape(processes, replicate, tp)
    except UserError as error:
        raise UserError(
            f"paratrain slurm: {args.nodes} machine(s) x {per_node} GPUs: {error}"
        ) from None
    copy = processes // replicate
    if _gathers_shards(options.strategy) and args.nodes > 1 and replicate == tp == 1:
        print(
            f"paratrain: note: --strategy {options.strategy} shards over all {processes} "
            f"processes of {args.nodes} "
            f"machines, so every step's gathers cross the network; --replicate {args.nodes} "
            "(HSDP) shards inside each machine and sends only a gradient all-reduce across",
            file=sys.stderr,
        )
    if replicate > 1 and per_node % copy:
        print(
            f"paratrain: note: each of the {replicate} copies ({copy} processes) spans "
            "machines, so the traffic inside a copy (fsdp's gathers, a pipeline's "
            f"activations) crosses the network every step; --replicate {args.nodes} keeps "
            "each copy on one machine",
            file=sys.stderr,
        )
    if tp > 1 and per_node % tp:
        print(
            f"paratrain: note: a tensor-parallel group of {tp} spans machines, so every "
            f"layer's activations cross the network; a --tp that divides {per_node} keeps "
            "each group on one machine",
            file=sys.stderr,
        )


def run(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise UserError("--nodes and --gpus-per-node must be at least 1")
    if args.signal_seconds < 1:
        raise UserError(f"--signal-seconds must be at least 1, got {args.signal_seconds}")
    train_args = _train_args(args)
    _check_mesh(args, _check_train_options(train_args))
    text = script(args, train_args)
    if args.output is None:
        print(text, end="")
    else:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}; submit it with: sbatch {args.output}")
    return 0
