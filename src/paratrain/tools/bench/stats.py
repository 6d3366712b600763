"""Median and spread of repeated measurements (airbench style: report the spread too)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float
    count: int

    @property
    def width(self) -> float:
        return self.max - self.min

    def overlaps(self, other: Spread) -> bool:
        return self.min <= other.max and other.min <= self.max

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("spread() needs at least one value")
    return Spread(
        median=float(statistics.median(values)),
        min=float(min(values)),
        max=float(max(values)),
        count=len(values),
    )


def throughputs(seconds: Sequence[float], samples: int) -> list[float]:
    """Samples per second of each repeat that trained ``samples`` samples."""
    return [samples / s for s in seconds if s > 0]
