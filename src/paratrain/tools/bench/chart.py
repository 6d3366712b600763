"""bench.png: throughput per combination beside memory per device.

Memory bars of one combination sit next to each other, so a first device that holds more
than the others (DataParallel's gather) stands out at a glance. matplotlib is optional
(``pip install 'paratrain[bench]'``) and imported only here, only when a chart is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratrain.tools.bench.memory import memory_bars
from paratrain.tools.bench.results import BenchReport
from paratrain.tools.bench.stats import spread
from paratrain.utils.atomic import atomic_write

MISSING_MATPLOTLIB = (
    "bench.png not written: matplotlib is not installed (pip install 'paratrain[bench]')"
)


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_chart(report: BenchReport, path: Path) -> bool:
    """Draw the chart into ``path``; False (nothing written) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    shown = [r for r in report.results if r.status != "skipped"]
    labels = [r.combo.label for r in shown]
    height = max(3.0, 0.55 * len(shown) + 1.5)
    figure = Figure(figsize=(13, height), layout="constrained")
    speed_ax, memory_ax = figure.subplots(1, 2, sharey=True)
    winner = report.recommendation.winner
    positions = list(range(len(shown)))

    for y, result in zip(positions, shown, strict=True):
        sps = result.samples_per_second()
        if not sps:
            speed_ax.text(0, y, f" {result.status}", va="center", color="tab:red")
            continue
        s = spread(sps)
        color = "tab:green" if result.combo.label == winner else "tab:blue"
        speed_ax.barh(
            y,
            s.median,
            color=color,
            xerr=[[s.median - s.min], [s.max - s.median]],
            capsize=3,
        )
    speed_ax.set_yticks(positions, labels)
    speed_ax.set_ylim(len(shown) - 0.5, -0.5)  # first combination on top, failed ones too
    speed_ax.set_xlabel("samples per second (median, min-max)")
    speed_ax.set_title("throughput (green: recommended)")

    _draw_memory(memory_ax, shown, positions)
    memory_ax.set_xlabel("peak memory (MiB)")
    memory_ax.set_title("peak memory per device (GPU), else per process (RSS)")
    figure.suptitle(f"paratrain bench: {report.settings.source.name}")

    def save(tmp: Path) -> None:
        figure.savefig(tmp, format="png", dpi=110)

    atomic_write(path, save)
    return True


def _draw_memory(ax: Any, shown: list[Any], positions: list[int]) -> None:
    per_result = [memory_bars(r.memory) for r in shown]
    names: list[str] = []
    for bars in per_result:
        names += [name for name, _ in bars if name not in names]
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
    for y, bars in zip(positions, per_result, strict=True):
        if not bars:
            continue
        width = 0.8 / len(bars)
        for i, (name, value) in enumerate(bars):
            offset = -0.4 + width * (i + 0.5)
            ax.barh(y + offset, value / 2**20, height=width, color=colors[name], label=name)
    handles, legend_labels = ax.get_legend_handles_labels()
    unique = dict(zip(legend_labels, handles, strict=True))
    if unique:
        ax.legend(
            unique.values(),
            unique.keys(),
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            fontsize="small",
        )
