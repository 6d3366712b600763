"""The table of trials: live on stderr while the search runs, final on stdout after it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


@dataclass
class Row:
    trial: str
    config: dict[str, Any]
    epochs: int
    last: float | None
    best: float | None
    status: str


def format_config(config: dict[str, Any]) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in sorted(config.items()))


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _figure(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


def build_table(rows: Sequence[Row], metric: str, title: str, best: str | None = None) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("trial", no_wrap=True)
    table.add_column("configuration")
    table.add_column(f"{metric} (last)", justify="right")
    table.add_column("best", justify="right")
    table.add_column("epochs", justify="right")
    table.add_column("status")
    for row in rows:
        mark = "* " if row.trial == best else ""
        table.add_row(
            f"{mark}{row.trial}",
            format_config(row.config),
            _figure(row.last),
            _figure(row.best),
            str(row.epochs),
            row.status,
            style="bold green" if row.trial == best else None,
        )
    return table


class LiveTrials:
    """A Ray Tune callback redrawing the table on stderr as results come in.

    Made a ``ray.tune.Callback`` in :mod:`paratrain.tools.tune.live`, so this module imports
    without Ray. Holds nothing that cannot be pickled until the search
    starts: Ray stores its callbacks with the experiment.
    """

    def __init__(self, metric: str, mode: str, title: str) -> None:
        self.metric, self.mode, self.title = metric, mode, title
        self._live: Live | None = None
        self._history: dict[str, list[float]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_live": None}

    def _rows(self, trials: Sequence[Any]) -> list[Row]:
        rows = []
        for trial in trials:
            values = self._history.get(trial.trial_id, [])
            finite = [v for v in values if math.isfinite(v)]
            pick = max if self.mode == "max" else min
            rows.append(
                Row(
                    trial.trial_id,
                    dict(trial.config),
                    int(trial.last_result.get("training_iteration", 0) or 0),
                    values[-1] if values else None,
                    pick(finite) if finite else None,
                    str(trial.status).lower(),
                )
            )
        return rows

    def _draw(self, trials: Sequence[Any]) -> None:
        table = build_table(self._rows(trials), self.metric, self.title)
        if self._live is None:
            self._live = Live(table, console=Console(stderr=True), transient=True)
            self._live.start()
        else:
            self._live.update(table)

    # -- ray.tune.Callback hooks --------------------------------------------------------------
    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._draw(trials)

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        if self.metric in result:
            self._history.setdefault(trial.trial_id, []).append(float(result[self.metric]))
        self._draw(trials)

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._draw(trials)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._draw(trials)

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
