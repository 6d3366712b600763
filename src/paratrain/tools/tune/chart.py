"""tune.png: the metric after every epoch, one line per trial, the best one highlighted.

A trial the scheduler stopped early is a short line, so ASHA's work shows at a glance.
matplotlib is optional and imported only here, only when a chart is drawn.
"""

from __future__ import annotations

import math
from pathlib import Path

from paratrain.tools.tune.display import format_config
from paratrain.tools.tune.outcome import TrialOutcome
from paratrain.utils.atomic import atomic_write

MISSING_MATPLOTLIB = (
    "tune.png not written: matplotlib is not installed (pip install 'paratrain[tune]')"
)


def write_chart(
    outcomes: list[TrialOutcome], best: TrialOutcome | None, metric: str, title: str, path: Path
) -> bool:
    """Draw the chart into ``path``; False (nothing written) without matplotlib."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return False
    figure = Figure(figsize=(9, 5.5), layout="constrained")
    ax = figure.subplots()
    for outcome in outcomes:
        if not outcome.history:
            continue
        epochs = list(range(1, outcome.epochs + 1))
        values = [v if math.isfinite(v) else math.nan for v in outcome.history]
        if best is not None and outcome.trial_id == best.trial_id:
            continue  # drawn last, on top
        ax.plot(epochs, values, marker="o", markersize=3, linewidth=1, alpha=0.45, color="grey")
        if outcome.status == "stopped":
            ax.plot(epochs[-1:], values[-1:], "x", color="tab:red", label="stopped early")
    if best is not None and best.history:
        ax.plot(
            range(1, best.epochs + 1),
            best.history,
            marker="o",
            linewidth=2.5,
            color="tab:green",
            label=f"best: {best.trial_id} ({format_config(best.config)})",
        )
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    if unique:
        ax.legend(unique.values(), unique.keys(), loc="best", fontsize="small")
    ax.set_xlabel("epoch")
    ax.set_ylabel(metric)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.set_title(title)

    def save(tmp: Path) -> None:
        figure.savefig(tmp, format="png", dpi=110)

    atomic_write(path, save)
    return True
