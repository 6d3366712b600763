"""`paratrain plan`'s table: one row per device of each layout."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from paratrain.tools.plan.planner import MAX_BATCH, MemoryPlan
from paratrain.tools.plan.trace import KINDS

#: the table's short headings of the kinds of memory
_HEADINGS = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer": "optim",
    "activations": "activ",
    "other": "other",
}


def gib(size: float) -> str:
    if size >= 1 << 30:
        return f"{size / (1 << 30):.2f}G"
    if size >= 1 << 20:
        return f"{size / (1 << 20):.1f}M"
    return f"{size / 1024:.0f}K"


def print_plan(plan: MemoryPlan, console: Console | None = None) -> None:
    console = console or Console(width=max(Console().width, 110))
    where = "all processes together" if plan.shared else "each device"
    table = Table(
        title=(
            f"{plan.model}: predicted peak memory per device, batch {plan.batch}, precision "
            f"{plan.precision}; {gib(plan.device_memory)} for {where} ({plan.memory_source})"
        )
    )
    table.add_column("layout")
    table.add_column("device", justify="right")
    for kind in KINDS:
        table.add_column(_HEADINGS[kind], justify="right")
    table.add_column("peak", justify="right")
    table.add_column("fits")
    table.add_column("max batch", justify="right")
    for layout in plan.layouts:
        for index, device in enumerate(layout.devices):
            first = index == 0
            table.add_row(
                layout.layout if first else "",
                str(index),
                *(gib(value) for value in device.as_dict().values()),
                gib(device.total),
                ("yes" if layout.fits else "no") if first else "",
                _largest(layout.largest_batch) if first else "",
            )
    console.print(table)
    for name, why in plan.refused.items():
        console.print(f"{name}: no row, it refuses the model: {why}", markup=False)
    console.print(
        "bytes: K, M, G (binary). Predicted from a traced step on fake tensors (nothing "
        "allocated); the largest batch follows a straight line through two traced batch sizes"
    )


def _largest(batch: int) -> str:
    return f">={MAX_BATCH}" if batch >= MAX_BATCH else str(batch)
