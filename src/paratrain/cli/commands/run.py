"""`paratrain run SCRIPT [ARGS...]`: your own script, in every process the strategy needs.

The processes are started by torchrun's API (`torch.distributed.run`), on this machine or,
with `--nnodes`, `--node-rank` and `--rdzv-endpoint`, on several. The script builds
`paratrain.Runtime(strategy="auto")`; `--strategy` and `--devices` reach it as
`PARATRAIN_STRATEGY` and `PARATRAIN_DEVICES`, which the runtime takes as its defaults.
The same script therefore also runs with plain `python` or `torchrun`.

paratrain's options may come before or after SCRIPT; after a `--` every argument is the
script's. `--hang-timeout` and `--skip-nonfinite` reach the script's runtime as
`PARATRAIN_HANG_TIMEOUT` and `PARATRAIN_NONFINITE=skip`.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path
from typing import Any

from paratrain.cli.commands.launch_options import (
    FLAG_OPTIONS,
    VALUE_OPTIONS,
    add_launch_arguments,
    apply_to_environment,
    nodes_from_args,
    requeue_on_stop,
    slurm_nodes,
)
from paratrain.launching.agent import run_agent
from paratrain.launching.preemption import Stopped
from paratrain.launching.threads import choose_for, say_note, started_note
from paratrain.utils import environment
from paratrain.utils.errors import UserError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run your own training script in every process the strategy needs (torchrun)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--strategy", default="auto", help="as for `paratrain train`")
    parser.add_argument("--devices", help="a count (2) or a list (0,1 / cuda:0,cuda:1 / cpu,cpu)")
    add_launch_arguments(parser)
    parser.add_argument("script", help="a Python script that uses paratrain.Runtime")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    parser.set_defaults(handler=run)


def split_own_options(
    args: list[str], strategy: str, devices: str | None
) -> tuple[str, str | None, list[str]]:
    """Take `--strategy`/`--devices` out of the script's arguments (up to `--`)."""
    own, rest = take_options(args, {"--strategy": strategy, "--devices": devices})
    return own["--strategy"] or "auto", own["--devices"], rest


def take_options(
    args: list[str], own: dict[str, str | None]
) -> tuple[dict[str, str | None], list[str]]:
    """Take the options named in ``own`` (and the launch flags) out of the script's
    arguments, up to `--`; returns their values and the script's arguments."""
    own = dict(own)
    rest: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            rest += args[index + 1 :]
            break
        name, equals, value = arg.partition("=")
        if name in FLAG_OPTIONS and not equals:
            own[name] = "1"
        elif name in own:
            if not equals:
                if index + 1 >= len(args):
                    raise UserError(f"{name} needs a value (see: paratrain run --help)")
                index += 1
                value = args[index]
            own[name] = value
        else:
            rest.append(arg)
        index += 1
    return own, rest


def _options_after_the_script(args: argparse.Namespace) -> list[str]:
    """Apply paratrain's options written after SCRIPT to ``args``; the script's arguments."""
    names = ["--strategy", "--devices", *VALUE_OPTIONS]
    given: dict[str, str | None] = dict.fromkeys(names)
    own, rest = take_options(list(args.script_args), given)
    for name, value in own.items():
        if value is None:
            continue
        attribute = name.removeprefix("--").replace("-", "_")
        if name in FLAG_OPTIONS:
            setattr(args, attribute, True)
        elif name in ("--nnodes", "--node-rank", "--max-restarts"):
            setattr(args, attribute, _integer(name, value))
        elif name == "--hang-timeout":
            setattr(args, attribute, _number(name, value))
        else:
            setattr(args, attribute, value)
    return rest


def _integer(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name} {value!r} must be a whole number") from None


def _number(name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise UserError(f"{name} {value!r} must be a number of seconds") from None


def run(args: argparse.Namespace) -> int:
    from paratrain.runtime.facade import DEVICES_VARIABLE, STRATEGY_VARIABLE, RuntimeConfig

    script_args = _options_after_the_script(args)
    strategy, devices = args.strategy or "auto", args.devices
    nodes_from_args(args)
    apply_to_environment(args)
    if not Path(args.script).is_file():
        raise UserError(f"script {args.script} does not exist")
    config = RuntimeConfig.from_keywords(strategy=strategy, devices=devices)
    processes = config.num_processes  # bad --devices fail here, before any process
    nodes, tasks = slurm_nodes(args, processes)
    env = {STRATEGY_VARIABLE: config.strategy_name}
    # set before torchrun: it warns and sets OMP_NUM_THREADS=1 where nobody chose
    threads = choose_for(processes)
    env.update(threads.child_environment())
    if devices is not None:
        env[DEVICES_VARIABLE] = devices
    try:
        if tasks is not None and not nodes.uses_agent:
            # srun started one task per process: this one is a rank, the script runs here
            environment.export(env)
            sys.argv = [args.script, *script_args]
            sys.path.insert(0, str(Path(args.script).resolve().parent))
            runpy.run_path(args.script, run_name="__main__")
            return 0
        entry = ["paratrain.cli.entry", "run", args.script, *script_args]
        say_note(started_note(threads, processes))
        run_agent(entry, processes, env, nodes, args.script, args.hang_timeout)
    except Stopped as stop:
        requeue_on_stop(args, tasks, stop)
        raise
    return 0
