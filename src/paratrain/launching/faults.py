"""Test hooks that make one rank fail at a given optimizer step, as clusters do.

``PARATRAIN_TEST_FAULT=KIND:RANK:STEP[:ATTEMPTS][,...]``, read once per process; KIND is

* ``kill``: the rank sends itself SIGKILL;
* ``stall``: the rank sleeps for an hour (a hang);
* ``nan``: the rank's loss becomes NaN;
* ``sigterm``, ``sigusr1``, ``sigint``: the rank sends itself that signal once (a stop
  request, as a cluster's scheduler or a Ctrl-C makes one) and trains on;
* ``launcher-sigterm``, ``launcher-sigint``: the same, sent to the process that started the
  rank (``paratrain``'s launcher or torchrun's agent).

``ATTEMPTS`` (default: every attempt) limits the fault to the first attempts of an elastic
run (``TORCHELASTIC_RESTART_COUNT`` below it). Without the variable nothing happens.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from paratrain.launching import preemption

FAULT_VARIABLE = "PARATRAIN_TEST_FAULT"
_SIGNALS = ("sigterm", "sigusr1", "sigint", "launcher-sigterm", "launcher-sigint")
_KINDS = ("kill", "stall", "nan", *_SIGNALS)
#: the faults of this process (kind, rank, step); False until read
_parsed: list[tuple[str, int, int]] | bool = False


def _faults() -> list[tuple[str, int, int]]:
    global _parsed
    if _parsed is False:
        _parsed = []
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        for item in (os.environ.get(FAULT_VARIABLE) or "").split(","):
            if not item:
                continue
            kind, rank, step, *attempts = item.split(":")
            if kind not in _KINDS:
                raise ValueError(f"{FAULT_VARIABLE}: unknown kind {kind!r}")
            if not attempts or restart < int(attempts[0]):
                _parsed.append((kind, int(rank), int(step)))
    return _parsed if isinstance(_parsed, list) else []


def at_step(rank: int, step: int, loss: Any) -> Any:
    """Apply the fault meant for ``rank`` at optimizer step ``step`` (1-based), if any."""
    planned = _faults()
    if not planned:  # the usual case, once a step: no list copied
        return loss
    for fault in list(planned):
        if fault[1:] != (rank, step):
            continue
        kind = fault[0]
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stall":
            time.sleep(3600)
        elif kind in _SIGNALS:
            _faults().remove(fault)  # once: each micro-batch of a step comes here
            target = os.getppid() if kind.startswith("launcher-") else os.getpid()
            os.kill(target, getattr(signal, kind.removeprefix("launcher-").upper()))
            if target != os.getpid():
                _await_forwarded()
        else:
            loss = loss * float("nan")
    return loss


#: seconds a rank waits for the signal it sent its launcher to come back
FORWARD_WAIT_SECONDS = 10.0


def _await_forwarded() -> None:
    """Wait until the launcher passed the signal on to this process, as a signal sent to
    the rank itself would be there at once: the step's agreement (before its backward)
    then carries it, and the run stops after this step, not one later."""
    deadline = time.monotonic() + FORWARD_WAIT_SECONDS
    while preemption.requested() is None and time.monotonic() < deadline:
        time.sleep(0.005)
