"""The recommendation: the fastest combination that fits in memory, and whether it truly
beat the runner-up or only tied within the measured noise (:mod:`paratrain.tools.bench.noise`):
a result within noise is never called a winner, and on a busy machine none is relied on.

A pure function of the measurements, so it is tested with given timings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paratrain.tools.bench.noise import compare
from paratrain.tools.bench.stats import spread


@dataclass(frozen=True)
class Candidate:
    label: str
    status: str  # "ok", "oom", "error" or "skipped"
    samples_per_second: Sequence[float] = ()


@dataclass(frozen=True)
class Recommendation:
    #: the fastest median; with ``tie`` or ``busy`` it is not a winner the bench vouches for
    winner: str | None
    runner_up: str | None = None
    #: how much faster the winner's median is than the runner-up's (0.12 = 12 %)
    margin: float | None = None
    tie: bool = False
    excluded: dict[str, str] = field(default_factory=dict)
    message: str = ""
    #: measured on a busy machine: rerun before relying on it
    busy: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "winner": self.winner,
            "runner_up": self.runner_up,
            "margin": self.margin,
            "tie": self.tie,
            "excluded": dict(self.excluded),
            "message": self.message,
            "busy": self.busy,
        }


def recommend(candidates: Sequence[Candidate], busy: bool = False) -> Recommendation:
    """Pick the fastest candidate that ran (``status == "ok"``); out-of-memory, failed and
    skipped ones are excluded and listed with their status. ``busy``: the machine was busy
    while measuring, which the message says."""
    excluded = {c.label: c.status for c in candidates if c.status != "ok"}
    windows = {c.label: c.samples_per_second for c in candidates}
    measured = [
        (c.label, spread(c.samples_per_second))
        for c in candidates
        if c.status == "ok" and c.samples_per_second
    ]
    excluded.update(
        {c.label: "no timings" for c in candidates if c.status == "ok" and not c.samples_per_second}
    )
    if not measured:
        return Recommendation(
            winner=None,
            excluded=excluded,
            message="no combination ran to completion, so there is nothing to recommend",
        )
    measured.sort(key=lambda item: item[1].median, reverse=True)
    best_label, best = measured[0]
    if len(measured) == 1:
        out_of_memory = [label for label, status in excluded.items() if status == "oom"]
        why = "the only combination that ran"
        if out_of_memory:
            why = f"the only layout that fits in memory ({', '.join(out_of_memory)}: out of memory)"
        return Recommendation(
            winner=best_label,
            excluded=excluded,
            message=f"use {best_label}: {best.median:,.0f} samples/s, {why}",
            busy=busy,
        )
    second_label, second = measured[1]
    margin = best.median / second.median - 1.0 if second.median > 0 else None
    verdict = compare(windows[best_label], windows[second_label])
    tie = verdict.tie
    percent = f"{margin:.1%}" if margin is not None else "n/a"
    if tie:
        message = (
            f"tie, no winner: {best_label} ({best.median:,.0f} samples/s) and {second_label} "
            f"({second.median:,.0f}) are within the measured noise ({verdict.why}); choose "
            "either, or rerun with more --repeats"
        )
    else:
        message = (
            f"use {best_label}: {best.median:,.0f} samples/s, {percent} faster than "
            f"{second_label} ({second.median:,.0f})"
        )
    if busy:
        message = f"{message} (measured on a busy machine: rerun on a quiet one to be sure)"
    return Recommendation(best_label, second_label, margin, tie, excluded, message, busy)
