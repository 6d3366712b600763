"""What each trial did, read from its run directory (paratrain's own files) and from Ray's
result; which trial is best; the best trial's run directory copied to ``OUT/best``."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.training import rundir
from paratrain.utils.atomic import fsync_dir

BEST = "best"
#: metric name -> (split, field) of the lines of metrics.jsonl
_METRIC_FIELDS = {
    "eval_accuracy": ("eval", "accuracy"),
    "eval_loss": ("eval", "loss"),
    "train_loss": ("train", "loss"),
}


@dataclass
class TrialOutcome:
    trial_id: str
    config: dict[str, Any]
    #: finished (trained every epoch), stopped (early, by the scheduler), error, unfinished
    status: str
    #: the metric after each epoch trained
    history: list[float]
    directory: Path
    error: str | None = None

    @property
    def epochs(self) -> int:
        return len(self.history)

    @property
    def last(self) -> float | None:
        return self.history[-1] if self.history else None

    def best(self, mode: str) -> float | None:
        finite = [v for v in self.history if math.isfinite(v)]
        if not finite:
            return None
        return max(finite) if mode == "max" else min(finite)

    def to_dict(self, mode: str, out: Path) -> dict[str, Any]:
        return {
            "id": self.trial_id,
            "config": self.config,
            "status": self.status,
            "epochs": self.epochs,
            "last": _finite(self.last),
            "best": _finite(self.best(mode)),
            "history": [_finite(v) for v in self.history],
            "directory": str(self.directory.resolve().relative_to(out.resolve())),
            "error": self.error,
        }


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def metric_history(run_dir: Path, metric: str) -> list[float]:
    """The metric after each epoch, from the run's metrics.jsonl (NaN where diverged)."""
    split, name = _METRIC_FIELDS[metric]
    path = run_dir / rundir.METRICS
    if not path.is_file():
        return []
    history: dict[int, float] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a stopped trial
        if record.get("split") == split and name in record:
            history[int(record["epoch"])] = float(record[name])
    return [history[epoch] for epoch in sorted(history)]


def outcome_of(result: Any, run_dir: Path, metric: str, config: dict[str, Any]) -> TrialOutcome:
    """One trial's outcome from its Ray ``Result`` and its run directory."""
    error = None
    if result.error is not None:
        error = (str(result.error).strip().splitlines() or [type(result.error).__name__])[-1]
        status = "error"
    elif rundir.read_status(run_dir) == "finished":
        status = "finished"
    elif result.metrics.get("done"):
        status = "stopped"
    else:
        status = "unfinished"
    return TrialOutcome(
        run_dir.name, config, status, metric_history(run_dir, metric), run_dir, error
    )


def pick_best(outcomes: list[TrialOutcome], mode: str) -> TrialOutcome | None:
    """The finished trial with the best final metric (its weights are those of that epoch)."""
    finished = [o for o in outcomes if o.status == "finished" and _finite(o.last) is not None]
    if not finished:
        return None
    sign = -1.0 if mode == "max" else 1.0
    return min(finished, key=lambda o: sign * float(o.last or 0.0))


def copy_best(best: TrialOutcome, out: Path) -> Path:
    """``out/best``: a copy of the best trial's run directory (weights, metrics.jsonl,
    config.json, checkpoints), replaced whole or not at all."""
    target = out / BEST
    tmp = out / f".{BEST}.tmp"
    old = out / f".{BEST}.old"
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.copytree(best.directory, tmp)
    if target.exists():
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(out)
    shutil.rmtree(old, ignore_errors=True)
    return target
