"""`paratrain bench loader`: sweep DataLoader num_workers x pin_memory, recommend one."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from paratrain.cli.commands.bench_source import add_source_arguments, source_from_args
from paratrain.cli.commands.options import hidden_alias, one_device
from paratrain.utils.errors import UserError

if TYPE_CHECKING:
    import torch


def register_loader(micro: Any) -> None:
    p = micro.add_parser(
        "loader",
        help="DataLoader num_workers x pin_memory: batches/s of the loader and of training",
        description="Time the recipe's (or script's) DataLoader for every num_workers up to "
        "--max-workers, with and without pin_memory: batches/s of the loader alone and of "
        "training steps fed by it, and recommend the fastest setting.",
    )
    add_source_arguments(p)
    p.add_argument("--batch-size", type=int, help="default: the recipe's (32 for a script)")
    p.add_argument(
        "--devices", help="the one device training steps run on (default cuda:0 if any, else cpu)"
    )
    hidden_alias(p, "--device", dest="devices")
    p.add_argument("--steps", type=int, default=30, help="timed batches per window (30)")
    hidden_alias(p, "--batches", dest="steps", type=int)
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first (3)")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per setting (3)")
    p.add_argument("--max-workers", type=int, help="largest num_workers (default: the cores)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model and data (default 0)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _device(name: str | None) -> torch.device:
    import torch

    if name is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--devices {name!r} is not a device (cpu, cuda:0, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--devices {name}: this machine has no CUDA GPU; use --devices cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--devices {name}: this machine has no Apple GPU; use --devices cpu")
    return device


def run_loader(args: argparse.Namespace) -> int:
    import torch

    from paratrain.tools.bench.loader import measure_loader
    from paratrain.tools.bench.task import load_task

    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
        ("--repeats", args.repeats, 1),
        ("--batch-size", args.batch_size, 1),
        ("--max-workers", args.max_workers, 0),
    ):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")
    source = source_from_args(args)
    device = _device(one_device(args.devices, "paratrain bench loader"))
    torch.manual_seed(args.seed)
    task = load_task(source, args.batch_size)
    batch_size = args.batch_size or task.default_batch_size
    if batch_size > len(task.dataset):  # type: ignore[arg-type]
        raise UserError(
            f"--batch-size {batch_size} is larger than the {len(task.dataset)} "  # type: ignore[arg-type]
            f"training samples of {source.name}"
        )
    show = (lambda text: print(f"measuring {text}", file=sys.stderr)) if not args.json else None
    report = measure_loader(
        task, device, batch_size, args.steps, args.warmup, args.repeats, args.max_workers, show
    )
    if args.json:
        print(json.dumps({"source": source.name, **report.to_dict()}, indent=2))
        return 0
    table = Table(
        title=f"DataLoader settings for {source.name}: batch {batch_size} on {report.device} "
        "(batches/s, median and min-max)"
    )
    for column in ("num_workers", "pin_memory", "loader alone", "training"):
        table.add_column(column, justify="right")
    for row in report.rows:
        table.add_row(
            str(row.setting.num_workers),
            str(row.setting.pin_memory),
            _rate(row.loader),
            _rate(row.training),
        )
    console = Console() if sys.stdout.isatty() else Console(width=120)
    console.print(table)
    console.print(f"training steps on a batch kept in memory: {_rate(report.step_alone)}")
    for note in report.notes:
        console.print(f"note: {note}")
    console.print(report.message)
    return 0


def _rate(s: Any) -> str:
    return f"{s.median:,.1f} ({s.min:,.1f}-{s.max:,.1f})"
