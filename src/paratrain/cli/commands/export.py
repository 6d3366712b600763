"""`paratrain export RUN --int8`: a quantized copy of a trained model, measured before/after."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export",
        help="a quantized (int8 / int4) copy of a trained model, measured before and after",
        description=(
            "Quantize the Linear layers of a trained run's model with torchao, write it to "
            "--out, and report file size, test accuracy (or loss) and latency per batch, "
            'before and after. Needs the export extra: pip install "paratrain[export]".'
        ),
    )
    p.add_argument(
        "source", metavar="RUN_OR_CHECKPOINT", help="a run directory or RUN/checkpoints/step-N"
    )
    scheme = p.add_mutually_exclusive_group(required=True)
    scheme.add_argument(
        "--int8",
        dest="scheme",
        action="store_const",
        const="int8",
        help="int8 weights, int8 dynamic activations (CPU)",
    )
    scheme.add_argument(
        "--int4",
        dest="scheme",
        action="store_const",
        const="int4",
        help="int4 weight-only (needs a CUDA GPU)",
    )
    p.add_argument("--out", help="the quantized file; default RUN/model-int8.pt (or -int4)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--data-dir", help="where the run's CIFAR-10 batches are now")
    p.add_argument("--repeats", type=int, default=20, help="timed batches for latency (20)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def run(args: argparse.Namespace) -> int:
    from paratrain.tools.export import export_model

    report = export_model(
        args.source, args.scheme, args.out, args.overwrite, args.data_dir, args.repeats
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    table = Table(
        title=f"{report.recipe}: float32 vs {report.scheme} ({report.description}); "
        f"latency: batch {report.batch_size} on {report.device}, median of {report.repeats}"
    )
    for column in ("model", "file", "test accuracy", "test loss", "latency / batch"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for fig in (report.before, report.after):
        table.add_row(
            fig.name,
            _size(fig.file_bytes),
            "-" if fig.test_accuracy is None else f"{fig.test_accuracy:.2%}",
            f"{fig.test_loss:.4f}",
            f"{fig.latency_seconds * 1000:.3f} ms",
        )
    console = Console() if sys.stdout.isatty() else Console(width=120)
    console.print(table)
    b, a = report.before, report.after
    console.print(
        f"{_size(b.file_bytes)} -> {_size(a.file_bytes)} "
        f"({b.file_bytes / max(a.file_bytes, 1):.2f}x smaller), latency x"
        f"{a.latency_seconds / max(b.latency_seconds, 1e-12):.2f}; quantized "
        f"{len(report.quantized_layers)} Linear layer(s) of {report.weight_layers} layers with "
        "weights (convolutions and the rest stay float)"
    )
    for note in report.notes:
        console.print(f"note: {note}")
    check = "same outputs" if report.reload_matches else "DIFFERENT outputs"
    console.print(
        f"wrote {report.out} (reloaded: {check}); run it with "
        f"paratrain.load_quantized({report.out!r})"
    )
    return 0 if report.reload_matches else 1
