"""plan.png: each layout's devices as stacked bars of parameters, gradients, optimizer
state, activations and the rest, with the device memory as a line. matplotlib is optional
(``pip install 'paratrain[bench]'``), imported only here."""

from __future__ import annotations

from pathlib import Path

from paratrain.tools.plan.planner import MemoryPlan
from paratrain.tools.plan.trace import KINDS
from paratrain.utils.atomic import atomic_write

MISSING_MATPLOTLIB = (
    "plan.png not written: matplotlib is not installed (pip install 'paratrain[bench]')"
)


def write_plan_chart(plan: MemoryPlan, path: Path) -> bool:
    """Draw into ``path``; False (nothing written) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    labels, stacks = [], []
    for layout in plan.layouts:
        for index, device in enumerate(layout.devices):
            labels.append(f"{layout.layout} #{index}")
            stacks.append([v / (1 << 30) for v in device.as_dict().values()])
    figure = Figure(figsize=(max(6.0, 0.6 * len(labels) + 2), 4.5), layout="constrained")
    ax = figure.subplots()
    bottoms = [0.0] * len(labels)
    for k, kind in enumerate(KINDS):
        values = [stack[k] for stack in stacks]
        ax.bar(labels, values, bottom=bottoms, label=kind)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    if not plan.shared:
        ax.axhline(plan.device_memory / (1 << 30), color="black", linestyle="--", label="device")
    ax.set_ylabel("GiB at the peak")
    ax.set_title(f"{plan.model}, batch {plan.batch}, {plan.precision}: predicted memory")
    ax.tick_params(axis="x", labelrotation=45)
    ax.legend(fontsize="small")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
    return True
