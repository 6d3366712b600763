"""A process paratrain starts dies with the process that started it.

Whatever stops a launcher (SIGTERM, SIGKILL, a closed pipe), its ranks must not train on
under PID 1, writing checkpoints into a run directory that someone may be resuming. On
Linux each rank asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``,
through ``prctl``); everywhere, the heartbeat (:mod:`paratrain.launching.heartbeat`) notices that
the parent
changed, the fallback where ``prctl`` does not exist. Checkpoints are written
crash-safely, so being killed at any moment leaves only complete ones.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Be killed (SIGKILL) when the parent process exits; exit now if it already has.
    Returns whether the kernel watches (Linux); the heartbeat checks in any case."""
    parent = os.getppid()
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)
    return armed


def process_exists(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
