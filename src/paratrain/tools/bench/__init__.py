"""Measuring layouts and precisions: `paratrain bench` and its micro-benchmarks.

from paratrain.tools.bench import BenchSettings, TaskSource, run_bench
report = run_bench(BenchSettings(TaskSource(recipe="digits"), strategies=["cpu"]))
print(report.recommendation.message)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paratrain.tools.bench.recommend import Candidate, Recommendation, recommend
    from paratrain.tools.bench.results import BenchReport, BenchSettings, RunResult
    from paratrain.tools.bench.runner import run_bench
    from paratrain.tools.bench.task import TaskSource

#: imported on first use: the command line reads this package's torch-free modules
#: (progress, crossover's sizes) to build `paratrain bench --help` without torch
_LAZY = {
    "Candidate": "paratrain.tools.bench.recommend",
    "Recommendation": "paratrain.tools.bench.recommend",
    "recommend": "paratrain.tools.bench.recommend",
    "BenchReport": "paratrain.tools.bench.results",
    "BenchSettings": "paratrain.tools.bench.results",
    "RunResult": "paratrain.tools.bench.results",
    "run_bench": "paratrain.tools.bench.runner",
    "TaskSource": "paratrain.tools.bench.task",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'paratrain.tools.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BenchReport",
    "BenchSettings",
    "Candidate",
    "Recommendation",
    "RunResult",
    "TaskSource",
    "recommend",
    "run_bench",
]
