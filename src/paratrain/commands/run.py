"""`paratrain run SCRIPT [ARGS...]`: your own script, in every process the strategy needs.

The processes are started by torchrun's API (`torch.distributed.run`). The script builds
`paratrain.Runtime(strategy="auto")`; `--strategy` and `--devices` reach it as
`PARATRAIN_STRATEGY` and `PARATRAIN_DEVICES`, which the runtime takes as its defaults.
The same script therefore also runs with plain `python` or `torchrun`.

paratrain's options may come before or after SCRIPT; after a `--` every argument is the
script's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from paratrain.errors import UserError
from paratrain.launch import run_script
from paratrain.runtime import DEVICES_VARIABLE, STRATEGY_VARIABLE, RuntimeConfig
from paratrain.strategies import build_strategy

_OWN_OPTIONS = ("--strategy", "--devices")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run your own training script in every process the strategy needs (torchrun)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--strategy", default="auto", help="as for `paratrain train`")
    parser.add_argument("--devices", help="a count (2) or a list (0,1 / cuda:0,cuda:1 / cpu,cpu)")
    parser.add_argument("script", help="a Python script that uses paratrain.Runtime")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    parser.set_defaults(handler=run)


def split_own_options(
    args: list[str], strategy: str, devices: str | None
) -> tuple[str, str | None, list[str]]:
    """Take `--strategy`/`--devices` out of the script's arguments (up to `--`)."""
    own = {"--strategy": strategy, "--devices": devices}
    rest: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            rest += args[index + 1 :]
            break
        name, equals, value = arg.partition("=")
        if name in _OWN_OPTIONS:
            if not equals:
                if index + 1 >= len(args):
                    raise UserError(f"{name} needs a value (see: paratrain run --help)")
                index += 1
                value = args[index]
            own[name] = value
        else:
            rest.append(arg)
        index += 1
    return own["--strategy"] or "auto", own["--devices"], rest


def run(args: argparse.Namespace) -> int:
    strategy, devices, script_args = split_own_options(
        list(args.script_args), args.strategy, args.devices
    )
    if not Path(args.script).is_file():
        raise UserError(f"script {args.script} does not exist")
    RuntimeConfig(strategy=strategy, devices=devices).validate()
    built = build_strategy(strategy, devices)  # bad --devices fail here, before any process
    env = {STRATEGY_VARIABLE: built.name}
    if devices is not None:
        env[DEVICES_VARIABLE] = devices
    run_script(args.script, script_args, built.num_processes, env)
    return 0
