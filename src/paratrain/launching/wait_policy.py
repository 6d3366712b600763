"""The OpenMP wait policy of the process the ``paratrain`` command runs in, chosen from the
machine's load when the command starts.

Imported first by the package, for its side effect: OpenMP reads its wait policy once,
when torch is imported, and `paratrain train --strategy cpu` trains in this very process.
Threads that spin while they wait are the fastest on a quiet machine (digits on 2 cores:
about 1.5x the samples/s of sleeping ones), and beside other busy processes they wait for a
core they do not have (about 3x slower than sleeping ones, 100x in the worst case). The
policy changes how fast a run is, never what it computes (the thread count does: see
:mod:`paratrain.launching.threads`, which reads the same look), so it follows the load: where
other work keeps a core busy when the command starts, ``OMP_WAIT_POLICY=PASSIVE``;
otherwise OpenMP's default. Only the command line (``paratrain ...``, ``python -m
paratrain``): a script that imports paratrain keeps its own setting. A policy the user set
is kept.
"""

from __future__ import annotations

import os
import sys
import time

from paratrain.utils import injection

PASSIVE = "PASSIVE"


def is_the_command() -> bool:
    """Whether this interpreter runs the ``paratrain`` command (``python -m paratrain`` is
    being imported while ``sys.argv[0]`` still reads ``-m``)."""
    first = sys.argv[0] if sys.argv else ""
    return first == "-m" or os.path.basename(first) == "paratrain"


def busy_cores(samples: int = 5, interval: float = 0.01) -> float:
    """How many cores other processes keep busy now: runnable tasks in ``/proc/loadavg``
    less this one (the median of a few looks), else the 1-minute load average."""
    looks: list[int] = []
    for i in range(samples):
        try:
            with open("/proc/loadavg", encoding="ascii") as handle:
                running = int(handle.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            break
        looks.append(max(0, running - 1))  # this process is running while it reads
        if i + 1 < samples:
            time.sleep(interval)
    if looks:
        return float(sorted(looks)[len(looks) // 2])
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def policy_for(busy: float) -> str | None:
    """``PASSIVE`` where at least one core is busy with other work, else None (OpenMP's
    default: spin a while, then sleep)."""
    return PASSIVE if busy >= 1.0 else None


def busy_now() -> float:
    """Cores other work keeps busy now (a fault injection point stands in for the machine
    in tests: :mod:`paratrain.utils.injection`)."""
    given = injection.busy_cores()
    return given if given is not None else busy_cores(samples=3, interval=0.005)


#: what the command saw when it started (None: not the command, or not looked yet)
_at_start: float | None = None


def busy_at_start() -> float:
    """Cores other work kept busy when this command started (its own work not yet
    running), else now: what the thread count of a run started here leaves to others."""
    return _at_start if _at_start is not None else busy_now()


if is_the_command() and "torch" not in sys.modules:
    _at_start = busy_now()
    _policy = policy_for(_at_start)
    if _policy is not None and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = _policy
