"""`paratrain ckpt inspect|convert`: what a checkpoint holds; rewrite it with plain names."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from paratrain.utils.errors import UserError

SHOWN_TENSORS = 20  # without --all


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ckpt",
        help="inspect and convert weights checkpoints",
        description="Inspect a weights file (.safetensors, or a torch.save file such as "
        "Lightning's .ckpt), a run directory or a checkpoint directory, or convert it to "
        "plain-named weights. Nothing pickled is run: torch.load(weights_only=True).",
    )
    sub = parser.add_subparsers(dest="ckpt_command", required=True, parser_class=type(parser))

    inspect = sub.add_parser(
        "inspect",
        help="tensors, size, prefixes and training state",
        description="What a checkpoint holds: its format, tensors and their dtypes, size, "
        "the key prefixes a wrapper added, and the training state (step, epoch) if any.",
    )
    inspect.add_argument("path", help="a weights file, run directory or checkpoint directory")
    inspect.add_argument("--all", action="store_true", help="list every tensor")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(handler=run_inspect)

    convert = sub.add_parser(
        "convert",
        help="write plain-named weights (.safetensors or .pt)",
        description="Write the weights of SRC to DST with plain names (the module. of "
        "DDP and DataParallel and the _orig_mod. of torch.compile removed), as "
        ".safetensors or .pt.",
    )
    convert.add_argument("src", help="a weights file, run directory or checkpoint directory")
    convert.add_argument(
        "dst", nargs="?", help="the file to write: .safetensors (recommended) or .pt/.pth"
    )
    convert.add_argument("--out", metavar="DST", help="the file to write, as DST (either one)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    convert.add_argument(
        "--strip-prefix",
        default="",
        metavar="PREFIX",
        help="also remove this prefix from the keys (e.g. Lightning's model.)",
    )
    convert.set_defaults(handler=run_convert)


def run_inspect(args: argparse.Namespace) -> int:
    from paratrain.checkpoints.files import read_checkpoint, summarize

    summary = summarize(read_checkpoint(args.path))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    console = Console(highlight=False, soft_wrap=True)
    label = Text(f"{summary['file'] or summary['source']}{summary['location']}", style="bold")
    console.print(Text.assemble(label, f" ({summary['format']})"))
    dtypes = ", ".join(f"{name} x{n}" for name, n in summary["dtypes"].items())
    console.print(
        f"tensors: {summary['count']} ({dtypes}); {summary['parameters']:,} values "
        f"(parameters and buffers); {_size(summary['bytes'])}",
        markup=False,
    )
    if summary["file_bytes"] is not None:
        console.print(f"file: {_size(summary['file_bytes'])} on disk", markup=False)
    count = summary["count"]
    prefixes = ", ".join(f"{p} ({n} of {count} keys)" for p, n in summary["prefixes"].items())
    console.print(f"prefixes: {prefixes or 'none (plain names)'}", markup=False)
    state = summary["training_state"]
    if state:
        text = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in state.items() if _scalar(v))
        console.print(f"training state: {text}", markup=False)
    if summary["latest_checkpoint"]:
        console.print(f"latest checkpoint: {summary['latest_checkpoint']}", markup=False)
    if summary["other_entries"]:
        console.print(f"other entries: {', '.join(summary['other_entries'])}", markup=False)
    if summary["metadata"]:
        meta = ", ".join(f"{k}={v}" for k, v in summary["metadata"].items())
        console.print(f"metadata: {meta}", markup=False)
    console.print(_tensor_table(summary["tensors"], args.all))
    if not args.all and summary["count"] > SHOWN_TENSORS:
        more = summary["count"] - SHOWN_TENSORS
        console.print(f"... {more} more tensors (--all lists every one)", markup=False)
    for hint in summary["hints"]:
        console.print(f"hint: {hint}", markup=False)
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from paratrain.checkpoints.files import convert_checkpoint

    if (args.dst is None) == (args.out is None):
        what = "both DST and --out" if args.dst else "neither DST nor --out"
        raise UserError(
            f"{what} given: name the file to write once (see: paratrain ckpt convert --help)"
        )
    dst = args.dst if args.dst is not None else args.out
    result = convert_checkpoint(args.src, dst, args.overwrite, args.strip_prefix)
    line = (
        f"wrote {result.destination} ({result.format}): {result.tensors} tensors, "
        f"{_size(result.bytes)}"
    )
    if result.removed:
        line += f"; removed prefixes: {', '.join(result.removed)}"
    if result.left_out:
        line += f"; not written (not weights): {', '.join(result.left_out)}"
    print(line)
    return 0


def _tensor_table(tensors: list[dict[str, Any]], show_all: bool) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("name", overflow="fold")
    table.add_column("shape")
    table.add_column("dtype")
    table.add_column("values", justify="right")
    for tensor in tensors if show_all else tensors[:SHOWN_TENSORS]:
        shape = "(" + ", ".join(map(str, tensor["shape"])) + ")" if tensor["shape"] else "scalar"
        table.add_row(Text(tensor["name"]), shape, tensor["dtype"], f"{tensor['numel']:,}")
    return table


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 1e6:.1f} MB)" if n >= 100_000 else f"{n:,} bytes"


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool))
