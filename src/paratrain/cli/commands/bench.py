"""`paratrain bench`: measure every layout and precision this machine runs, and recommend one.

`paratrain bench placement` and `paratrain bench crossover` are the micro-benchmarks of
seeds 002 and 003; `paratrain bench loader` tunes the DataLoader (commands/bench_loader.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from paratrain.cli.commands.bench_loader import register_loader, run_loader
from paratrain.cli.commands.bench_source import add_source_arguments, source_from_args
from paratrain.cli.commands.options import hidden_alias, one_device
from paratrain.tools.bench.crossover import DEFAULT_SIZES
from paratrain.tools.bench.progress import BenchProgress
from paratrain.utils.errors import UserError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure which layout and precision is fastest here",
        description=(
            "Train real steps of a model with every strategy, precision and batch size this "
            "machine supports, each in a fresh process; report throughput, step time and "
            "peak memory per device, and recommend the fastest that fits."
        ),
    )
    add_source_arguments(p)
    p.add_argument("--strategies", help="comma list; default: every strategy available here")
    p.add_argument("--precisions", help="comma list of 32, bf16, fp16; default: native ones")
    p.add_argument("--batch-sizes", help="comma list of global batch sizes; default: recipe's")
    p.add_argument("--devices", help="for multi-device strategies: a count or a list (cpu,cpu)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per window (default 100)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed windows per combination (default 5)"
    )
    p.add_argument(
        "--threads",
        metavar="N[,N...]",
        help="intra-op threads per process to measure on CPU layouts (default: the count "
        "paratrain chooses, and 1 for one process)",
    )
    p.add_argument(
        "--instances",
        type=int,
        metavar="N",
        help="worker processes per combination, its windows taking turns among them "
        "(default 2 on CPU layouts, 1 on GPUs)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the model and data (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    p.add_argument("--out", help="output directory; default runs/bench-<name>-<timestamp>")
    p.add_argument("--overwrite", action="store_true", help="replace a bench.json in --out")
    p.add_argument("--no-plot", action="store_true", help="do not write bench.png")
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="also measure each combination with activation checkpointing (time it costs, "
        "memory it saves); doubles the runs",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--json", action="store_true", help="print bench.json's contents instead of the table"
    )
    p.set_defaults(handler=run)
    micro = p.add_subparsers(
        dest="micro", metavar="{placement,crossover,loader}", action=_MicroBenchmarks
    )
    _register_micro(micro)
    register_loader(micro)


class _MicroBenchmarks(argparse._SubParsersAction):
    """``paratrain bench OPTIONS loader ...``: an option given before the micro-benchmark's
    name applies to it where it has that option and is refused where it has not (argparse
    would let the micro-benchmark's defaults replace it without a word)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = {
            action.dest: (action.option_strings[0], getattr(namespace, action.dest))
            for action in parser._actions
            if action.option_strings
            and getattr(namespace, action.dest, action.default) != action.default
        }
        super().__call__(parser, namespace, values, option_string)
        name = values[0]
        command = f"{parser.prog} {name}"
        defaults = {
            action.dest: action.default
            for action in self.choices[name]._actions
            if action.option_strings and action.default is not argparse.SUPPRESS
        }
        for dest, (flag, value) in given.items():
            if dest not in defaults:
                raise UserError(
                    f"{flag} is an option of {parser.prog}, not of {command} "
                    f"(see: {command} --help)"
                )
            if getattr(namespace, dest) != defaults[dest]:
                raise UserError(f"{flag} is given before and after {name}: give it once")
            setattr(namespace, dest, value)


def settings_from_args(args: argparse.Namespace) -> Any:
    from paratrain.tools.bench.combos import (
        parse_batch_sizes,
        parse_precision_list,
        parse_strategy_list,
        parse_thread_counts,
    )
    from paratrain.tools.bench.results import BenchSettings

    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
        ("--repeats", args.repeats, 1),
        ("--instances", 1 if args.instances is None else args.instances, 1),
    ):
        if value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")
    if args.timeout <= 0:
        raise UserError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    return BenchSettings(
        source=source_from_args(args),
        strategies=parse_strategy_list(args.strategies),
        precisions=parse_precision_list(args.precisions),
        batch_sizes=parse_batch_sizes(args.batch_sizes),
        devices=args.devices,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        timeout=args.timeout,
        activation_checkpointing=args.activation_checkpointing,
        threads=parse_thread_counts(args.threads),
        instances=args.instances,
    )


def run(args: argparse.Namespace) -> int:
    if args.micro == "placement":
        return run_placement(args)
    if args.micro == "crossover":
        return run_crossover(args)
    if args.micro == "loader":
        return run_loader(args)
    from paratrain.tools.bench.chart import MISSING_MATPLOTLIB, write_chart
    from paratrain.tools.bench.report import (
        BENCH_JSON,
        BENCH_PNG,
        check_out,
        make_out,
        print_report,
        write_json,
    )
    from paratrain.tools.bench.runner import run_bench

    settings = settings_from_args(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = check_out(Path(args.out or f"runs/bench-{settings.source.name}-{stamp}"), args.overwrite)
    # --overwrite replaces an earlier bench here: its chart must not outlive it
    replacing = (out / BENCH_JSON).exists()
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # piped output: no need to squeeze into 80 columns
    with BenchProgress(enabled=not args.no_progress) as bar:
        report = run_bench(settings, bar.update)
    predict_memory(report)
    report.arguments = {k: v for k, v in vars(args).items() if not k.endswith("handler")}
    make_out(out)
    if replacing:
        (out / BENCH_PNG).unlink(missing_ok=True)
    if getattr(args, "json", False):
        print(write_json(report, out).read_text(encoding="utf-8"), end="")
        return 0
    print_report(report, console)
    written = [write_json(report, out)]
    if not args.no_plot:
        if write_chart(report, out / BENCH_PNG):
            written.append(out / BENCH_PNG)
        else:
            console.print(MISSING_MATPLOTLIB)
    console.print(f"wrote {', '.join(str(p) for p in written)} ({report.wall_seconds:.0f}s)")
    return 0


def predict_memory(report: Any) -> None:
    """``paratrain plan``'s peak per device next to each measured combination: one traced
    plan (on fake tensors) per precision, batch size, device count and checkpointing (and
    one with the two-dimensional layouts' own traces, where one of them was measured)."""
    from paratrain.cli.commands.plan import task_builder

    build, _ = task_builder(report.settings.source)
    plans: dict[tuple[str, int, int, bool, str, bool], Any] = {}
    for result in report.results:
        combo = result.combo
        if result.status == "skipped" or not combo.device_names:
            continue
        accelerator = combo.device_names[0].split(":")[0]
        count = len(combo.device_names)
        mesh = combo.replicate * combo.tp > 1
        key = (
            combo.precision, combo.batch_size, count, combo.activation_checkpointing,
            accelerator, mesh,
        )  # fmt: skip
        if key not in plans:
            try:
                plans[key] = _plan(build, report.settings.source.name, *key)
            except Exception:  # a model the tracer cannot follow: the measurement still stands
                plans[key] = None
        planned = plans[key]
        name = combo.layout if mesh else combo.strategy if count > 1 else accelerator
        found = [p for p in planned.layouts if p.layout == name] if planned else []
        if found:
            result.predicted_peak_bytes = [d.total for d in found[0].devices]


def _plan(
    build: Any,
    model: str,
    precision: str,
    batch: int,
    count: int,
    recompute: bool,
    accelerator: str,
    mesh: bool,
) -> Any:
    """`paratrain plan`'s plan of ``count`` devices; ``mesh``: with the traces of its
    two-dimensional rows (a pipeline copy's stages, a tensor parallel pair's process)."""
    from paratrain.cli.commands.plan import (
        shared_traces,
        tensor_parallel_tracer,
        with_checkpointing,
    )
    from paratrain.tools.plan import plan_memory

    wrap = with_checkpointing if recompute else None
    traced = shared_traces(build, precision, wrap, (count, count // 2) if mesh else (count,))
    copies = tp = None
    if mesh:
        copies = traced[count // 2]
        tp = tensor_parallel_tracer(build, count, precision, wrap)[0]
    return plan_memory(
        traced[count], model, batch, precision, count, accelerator, 1 << 60, "-", copies, tp
    )


# -- micro-benchmarks (seeds 002 and 003) -------------------------------------------------------
def _register_micro(micro: Any) -> None:
    p = micro.add_parser(
        "placement",
        help="create on the CPU then copy vs create on the GPU; pageable vs pinned copies",
        description="Time an n x n float32 tensor created on the CPU and copied to the GPU "
        "against one created on the GPU, and copies from pageable against pinned memory "
        "(GB/s); also what a timer that does not synchronize would report.",
    )
    p.add_argument("--devices", help="the one GPU to measure (default cuda:0, else mps)")
    hidden_alias(p, "--device", dest="devices")
    p.add_argument("--size", type=int, default=10000, help="n for n x n float32 (default 10000)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls each (default 10)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    c = micro.add_parser(
        "crossover",
        help="matrix sizes from which the GPU beats the CPU",
        description="Time a @ b for n x n float32 matrices on the CPU and on the GPU (with "
        "and without the copies there and back), and say from which n the GPU wins.",
    )
    c.add_argument("--devices", help="the one GPU to measure (default cuda:0, else mps)")
    hidden_alias(c, "--device", dest="devices")
    c.add_argument(
        "--sizes",
        default=",".join(str(n) for n in DEFAULT_SIZES),
        help="comma list of n for n x n matrices",
    )
    c.add_argument("--repeats", type=int, default=5, help="timed calls each (default 5)")
    c.add_argument("--json", action="store_true", help="machine-readable output")


def _check_micro(args: argparse.Namespace) -> None:
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")


def _ms(spread: Any) -> str:
    return f"{spread.median * 1000:.3f}"


def run_placement(args: argparse.Namespace) -> int:
    from rich.table import Table

    from paratrain.tools.bench.placement import measure_placement
    from paratrain.tools.bench.timing import NO_GPU, pick_gpu

    _check_micro(args)
    if args.size < 1:
        raise UserError(f"--size must be at least 1, got {args.size}")
    device = pick_gpu(one_device(args.devices, f"paratrain bench {args.micro}"))
    if device is None:
        print(f"paratrain bench placement: {NO_GPU}")
        return 0
    rows = measure_placement(device, args.size, args.repeats)
    if args.json:
        payload = {"device": str(device), "size": args.size, "rows": [r.to_dict() for r in rows]}
        print(json.dumps(payload, indent=2))
        return 0
    table = Table(title=f"placement of a {args.size}x{args.size} float32 tensor on {device}")
    for column in ("how", "median ms", "min-max ms", "GB/s", "note"):
        table.add_column(column, justify="left" if column in ("how", "note") else "right")
    for row in rows:
        s = row.seconds
        gbps = row.gb_per_second
        table.add_row(
            row.name,
            "-" if s is None else _ms(s),
            "-" if s is None else f"{s.min * 1000:.3f}-{s.max * 1000:.3f}",
            "-" if gbps is None else f"{gbps:.1f}",
            row.note,
        )
    Console().print(table)
    return 0


def run_crossover(args: argparse.Namespace) -> int:
    from rich.table import Table

    from paratrain.tools.bench.combos import parse_batch_sizes
    from paratrain.tools.bench.crossover import crossover_size, measure_crossover
    from paratrain.tools.bench.timing import NO_GPU, pick_gpu

    _check_micro(args)
    sizes = parse_batch_sizes(args.sizes.replace(" ", "")) or []
    device = pick_gpu(one_device(args.devices, f"paratrain bench {args.micro}"))
    if device is None:
        print(f"paratrain bench crossover: {NO_GPU}")
        return 0
    rows = measure_crossover(device, sizes, args.repeats)
    size = crossover_size(
        [r.size for r in rows],
        [r.cpu.median for r in rows],
        [r.gpu_with_transfers.median for r in rows],
    )
    verdict = (
        f"the GPU ({device}) wins from {size}x{size} on, copies included"
        if size is not None
        else f"the CPU was as fast or faster at every size measured than {device}"
    )
    if args.json:
        payload = {
            "device": str(device),
            "crossover_size": size,
            "rows": [r.to_dict() for r in rows],
        }
        print(json.dumps(payload, indent=2))
        return 0
    table = Table(title=f"a @ b for n x n float32: CPU vs {device}")
    for column in ("n", "CPU ms", "GPU ms (with copies)", "GPU ms (compute)", "faster"):
        table.add_column(column, justify="right")
    for row in rows:
        faster = "GPU" if row.gpu_with_transfers.median < row.cpu.median else "CPU"
        table.add_row(
            str(row.size),
            _ms(row.cpu),
            _ms(row.gpu_with_transfers),
            _ms(row.gpu_compute),
            faster,
        )
    console = Console()
    console.print(table)
    console.print(verdict)
    return 0
