"""How many intra-op threads each process paratrain runs uses, chosen on purpose.

Left alone, torch gives every process one OpenMP thread per core, and OpenMP's threads
spin while they wait. With one other busy process on the machine a spinning thread waits
for a core it does not have, and a small model trains ~100x slower (2 cores, digits:
108 samples/s instead of ~11,000). So paratrain chooses, once, when a run starts:

* the cores this process may use, less those other work keeps busy at that moment,
  divided by the processes of the run (at least one thread each, never more than the
  cores allow). Two threads sharing one free core with another program keep ~40% of their
  speed; one thread alone on it keeps ~70%. A different count sums in another order (the
  weights' last bits may differ), so the count is fixed for the whole run, recorded in
  ``config.json``, said on stderr when the load changed it, and a resumed run uses the
  recorded count; ``--deterministic`` (or ``--threads``) keeps it independent of the load;
* ``OMP_WAIT_POLICY=PASSIVE`` for the processes it starts (read by OpenMP when torch is
  imported): a waiting thread sleeps instead of spinning, so a machine that gets busy
  later costs a few times, not a hundred. The process ``paratrain`` itself runs in sleeps
  too where the machine is busy when the command starts, and spins (fastest) where it is
  quiet (:mod:`paratrain.launching.wait_policy`: the policy changes the speed, never the
  weights).

An explicit choice wins: ``threads`` (``--threads``, ``Runtime(threads=...)``), then
``OMP_NUM_THREADS`` set by the user.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from paratrain.launching import wait_policy

#: set by paratrain for the processes it starts: the thread count chosen for them
CHOSEN_VARIABLE = "PARATRAIN_THREADS"
#: why (one line), handed to the processes paratrain starts with the count
REASON_VARIABLE = "PARATRAIN_THREADS_REASON"
PASSIVE = "PASSIVE"


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op threads of each process of a run, and why."""

    threads: int
    #: OMP_WAIT_POLICY for the processes paratrain starts (this process keeps what it has)
    wait_policy: str
    #: "threads" (given), "OMP_NUM_THREADS" (the user's environment) or "chosen"
    source: str
    reason: str

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    def child_environment(self) -> dict[str, str]:
        """What a process paratrain starts needs before it imports torch."""
        return {
            "OMP_NUM_THREADS": str(self.threads),
            "OMP_WAIT_POLICY": self.wait_policy,
            CHOSEN_VARIABLE: str(self.threads),
            REASON_VARIABLE: self.reason,
        }


def started_note(choice: ThreadChoice, processes: int) -> str | None:
    """The one line a launcher says when it set ``OMP_NUM_THREADS`` for the ``processes``
    it starts (torchrun would otherwise warn and choose 1); None where the user chose."""
    if choice.source != "chosen":
        return None
    return (
        f"paratrain: note: OMP_NUM_THREADS={choice.threads} for each of the {processes} "
        f"process(es) it starts ({choice.reason}); set OMP_NUM_THREADS to choose otherwise"
    )


def say_note(note: str | None) -> None:
    """Print ``note`` (from :func:`started_note`) on stderr, if there is one."""
    if note is not None:
        print(note, file=sys.stderr, flush=True)


def choose_threads(
    cores: int,
    processes: int,
    requested: int | None = None,
    inherited: str | None = None,
    busy: float = 0.0,
) -> ThreadChoice:
    """The thread count for each of ``processes`` processes on ``cores`` usable cores, of
    which other work keeps ``busy`` busy (whole cores count: a core is busy from 1.0).

    ``requested``: an explicit count (wins); ``inherited``: ``OMP_NUM_THREADS`` as the user
    set it (wins over the choice when it is a positive integer).
    """
    cores, processes = max(1, cores), max(1, processes)
    if requested is not None:
        return ThreadChoice(requested, PASSIVE, "threads", f"{requested} as asked")
    if inherited is not None and inherited.strip().isdigit() and int(inherited) > 0:
        count = int(inherited)
        return ThreadChoice(count, PASSIVE, "OMP_NUM_THREADS", f"OMP_NUM_THREADS={count}")
    taken = min(int(max(0.0, busy)), cores - 1)  # at least one core stays ours
    threads = max(1, (cores - taken) // processes)
    if taken:
        reason = (
            f"{cores} cores, {taken} busy with other work when the run started / "
            f"{processes} process(es): {threads} thread(s) each"
        )
    else:
        reason = f"{cores} cores / {processes} process(es): {threads} thread(s) each"
    return ThreadChoice(threads, PASSIVE, "chosen", reason)


def load_note(choice: ThreadChoice, processes: int) -> str | None:
    """One line for stderr where the load made ``choice`` smaller than a quiet machine's
    count (else None)."""
    quiet = choose_threads(usable_cores(), processes).threads
    if choice.source != "chosen" or choice.threads >= quiet:
        return None
    return (
        f"other work keeps cores busy: {choice.threads} intra-op thread(s) per process "
        f"instead of {quiet} ({choice.reason}; recorded in config.json, and a resume keeps "
        f"it); --threads {quiet} or --deterministic uses the quiet machine's count"
    )


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def inherited_choice() -> ThreadChoice | None:
    """The choice paratrain made for this process when it started it, if it did."""
    chosen = os.environ.get(CHOSEN_VARIABLE, "")
    if not chosen.isdigit() or int(chosen) < 1:
        return None
    policy = os.environ.get("OMP_WAIT_POLICY", "") or "default"
    reason = os.environ.get(REASON_VARIABLE, "") or f"{chosen} thread(s), set by the launcher"
    return ThreadChoice(int(chosen), policy, "chosen", reason)


def choose_for(
    processes: int, requested: int | None = None, follow_load: bool = True
) -> ThreadChoice:
    """The choice for a run of ``processes`` processes started from this one; where
    ``follow_load``, the cores other work keeps busy now are left to it."""
    inherited = inherited_choice()
    if requested is None and inherited is not None:
        return inherited
    given = os.environ.get("OMP_NUM_THREADS")
    busy = 0.0
    if follow_load and requested is None and not given:
        busy = wait_policy.busy_at_start()
    choice = choose_threads(usable_cores(), processes, requested, given, busy)
    policy = os.environ.get("OMP_WAIT_POLICY")
    return dataclasses.replace(choice, wait_policy=policy) if policy else choice


def apply_here(choice: ThreadChoice) -> None:
    """This process's intra-op threads (its wait policy was fixed when torch was imported)."""
    import torch

    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)


def run_delay_seconds() -> float | None:
    """Seconds this process's threads have waited for a core so far (Linux schedstat)."""
    total = 0
    try:
        for task in os.scandir("/proc/self/task"):
            with open(f"{task.path}/schedstat", encoding="ascii") as handle:
                total += int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


class ContentionGuard:
    """Says once, on stderr, when this process's threads keep waiting for cores (other
    work that started after the run: an indexer, a test suite), checked every
    ``interval`` seconds. It never changes the thread count during a run: another count
    sums in another order, and the weights would then depend on when the machine got
    busy. Sleeping waiters (``OMP_WAIT_POLICY=PASSIVE``) keep such a run from collapsing."""

    #: share of the time a thread waited for a core, above which the cores are contended
    THRESHOLD = 0.25
    #: seconds between looks
    INTERVAL = 1.0

    def __init__(self, threads: int, interval: float | None = None) -> None:
        self.threads = threads
        self.interval = self.INTERVAL if interval is None else interval
        self._last = time.perf_counter()
        self._delay = run_delay_seconds() if threads > 1 else None

    def check(self) -> str | None:
        """Call often (a clock read); returns a note once, when the cores are contended."""
        if self._delay is None:
            return None
        now = time.perf_counter()
        if now - self._last < self.interval:
            return None
        delay = run_delay_seconds()
        if delay is None:
            self._delay = None
            return None
        waited = (delay - self._delay) / (max(now - self._last, 1e-9) * self.threads)
        self._last, self._delay = now, delay
        if waited < self.THRESHOLD:
            return None
        self._delay = None  # said once
        return (
            f"other work keeps this machine's cores busy (threads waited {waited:.0%} of the "
            f"time for one) since this run started: it keeps its {self.threads} intra-op "
            "threads, so that its weights do not depend on when the machine got busy; a run "
            "started now would choose fewer (--threads 1 trains faster beside other work)"
        )
