"""How sure a bench can be: the machine's load while it measured, and how far apart two
results must be before one is called faster.

Pure functions of what was measured (the load is read by :func:`load_sample`), so the
verdicts are tested with synthetic timings.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from paratrain.launching.threads import usable_cores
from paratrain.launching.wait_policy import busy_cores
from paratrain.tools.bench.stats import Spread, spread

#: closer than this, two layouts are the same speed whatever the spread says: run-to-run
#: differences of a few percent are normal even on a quiet machine
NOISE_FLOOR = 0.05
#: a median of this many cores busy with other work, looked at between runs: a busy machine
BUSY_CORES = 0.5


def relative_spread(spread: Spread) -> float:
    """(max - min) / median: 0.1 means the repeats vary over 10% of the median."""
    return spread.width / spread.median if spread.median > 0 else float("inf")


def within_noise(winner: Spread, runner_up: Spread) -> bool:
    """Whether the difference of the medians of two measurements that were not interleaved
    is no larger than what repeating the same measurement gives: overlapping ranges, a
    difference smaller than the narrower spread (the wider one may stem from a single
    outlier window), or closer than NOISE_FLOOR."""
    difference = winner.median - runner_up.median
    if runner_up.median > 0 and difference / runner_up.median < NOISE_FLOOR:
        return True
    return winner.overlaps(runner_up) or difference < min(winner.width, runner_up.width)


#: of the rounds two combinations were both timed in, the faster median must win at least
#: this share to be called faster (4 of 5, 5 of 7, 3 of 3)
CONSISTENT_SHARE = 0.7
#: fewer rounds in common than this: the ranges decide (:func:`within_noise`)
MIN_PAIRS = 3


@dataclass(frozen=True)
class Verdict:
    """Whether the faster median truly beat the other, and the reason when not."""

    tie: bool
    #: why it is a tie, to finish "within the measured noise (...)"; "" when it is not
    why: str = ""


def compare(winner: Sequence[float], runner_up: Sequence[float]) -> Verdict:
    """``winner`` (the faster median) against ``runner_up``: samples/s of each window, in
    the order they were timed.

    The bench interleaves the combinations, so window i of each was timed in the same round,
    seconds apart: a drift of the whole machine moves both alike, and comparing them round by
    round cancels it (comparing ranges does not: more windows only widen them). A tie when
    the medians are closer than NOISE_FLOOR, or when the winner was faster in less than
    CONSISTENT_SHARE of the rounds they share; with fewer than MIN_PAIRS such rounds,
    :func:`within_noise` of their ranges.
    """
    first, second = spread(winner), spread(runner_up)
    apart = first.median / second.median - 1 if second.median > 0 else float("inf")
    if apart < NOISE_FLOOR:
        return Verdict(True, f"medians {apart:.1%} apart, closer than the {NOISE_FLOOR:.0%} floor")
    pairs = list(zip(winner, runner_up, strict=False))
    if len(pairs) < MIN_PAIRS:
        if within_noise(first, second):
            noise = max(relative_spread(first), relative_spread(second))
            return Verdict(True, f"medians {apart:.1%} apart, repeats varying by up to {noise:.0%}")
        return Verdict(False)
    wins = sum(a > b for a, b in pairs)
    if wins < CONSISTENT_SHARE * len(pairs):
        return Verdict(
            True, f"medians {apart:.1%} apart, but faster in only {wins} of {len(pairs)} rounds"
        )
    return Verdict(False)


#: a combination whose fastest window is slower than this share of the leader's slowest
#: window cannot win: it is stopped early (its windows so far stay in the report)
CLEAR_LOSER = 0.6


def clear_losers(speeds: Mapping[str, Sequence[float]]) -> list[str]:
    """The combinations, of those with at least two windows (samples/s each), that are
    slower in their best window than ``CLEAR_LOSER`` times the leader (the best median)
    in its worst: far outside any noise, so more windows would not change the verdict."""
    measured = {label: s for label, s in speeds.items() if len(s) >= 2}
    if len(measured) < 2:
        return []
    leader = max(measured, key=lambda label: statistics.median(measured[label]))
    bar = CLEAR_LOSER * min(measured[leader])
    return [label for label, s in measured.items() if label != leader and max(s) < bar]


@dataclass(frozen=True)
class MachineLoad:
    """Other work on the machine while the bench measured (looked at between its runs,
    when none of its own processes ran)."""

    cores: int
    #: cores busy with other work at each look
    busy: tuple[float, ...] = ()
    #: the 1-minute load average at the start and at the end
    load_average: tuple[float, ...] = ()
    #: processes on the GPUs that are not the bench's (pids), where nvidia-smi tells
    gpu_processes: tuple[int, ...] = ()

    @property
    def busy_median(self) -> float:
        return float(statistics.median(self.busy)) if self.busy else 0.0

    @property
    def is_busy(self) -> bool:
        return self.busy_median >= BUSY_CORES or bool(self.gpu_processes)

    def sentence(self) -> str:
        """One line on the load; a busy machine said plainly, with what to do."""
        averages = ", ".join(f"{a:.1f}" for a in self.load_average) or "n/a"
        seen = f"load average {averages} on {self.cores} cores"
        if self.gpu_processes:
            pids = ", ".join(str(p) for p in self.gpu_processes)
            return (
                f"the machine was busy: other processes on the GPU ({pids}); {seen}. These "
                "figures are not reliable: rerun the bench when the GPU is free"
            )
        if self.is_busy:
            return (
                f"the machine was busy: other work kept {self.busy_median:.1f} of "
                f"{self.cores} cores busy ({seen}). These figures are not reliable: rerun "
                "the bench on a quiet machine"
            )
        return f"the machine was quiet: {seen}, no other busy process seen between runs"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "busy_median": self.busy_median, "is_busy": self.is_busy}


def load_sample() -> float:
    """Cores busy with other work now (call it while none of the bench's processes run)."""
    return busy_cores()


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def gpu_processes(own: Sequence[int] = ()) -> tuple[int, ...]:
    """Pids of the compute processes on this machine's NVIDIA GPUs, less ``own``."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        listed = subprocess.run(
            [smi, "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    pids = {int(line) for line in listed.split() if line.strip().isdigit()}
    return tuple(sorted(pids - set(own)))


def cores() -> int:
    return usable_cores()
