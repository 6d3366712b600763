"""Measuring layouts and precisions: `paratrain bench` and its micro-benchmarks.

from paratrain.bench import BenchSettings, TaskSource, run_bench
report = run_bench(BenchSettings(TaskSource(recipe="digits"), strategies=["cpu"]))
print(report.recommendation.message)
"""

from __future__ import annotations

from paratrain.bench.recommend import Candidate, Recommendation, recommend
from paratrain.bench.runner import BenchReport, BenchSettings, RunResult, run_bench
from paratrain.bench.task import TaskSource

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
