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

from paratrain.utils import environment

_PR_SET_PDEATHSIG = 1
#: the pid of the process that started this one, as that process knew itself: set by
#: paratrain's launchers for the processes they start
PARENT_VARIABLE = environment.PARENT_VARIABLE


def die_with_parent(parent: int | None = None) -> bool:
    """Be killed (SIGKILL) when the parent process exits; exit now if it already has.

    ``parent`` (else ``PARATRAIN_PARENT_PID``, else the parent now): the pid of the process
    that started this one, as the starter gave it. A process looks only once it has
    imported torch, a second or more after it started; a parent killed meanwhile has
    already been replaced by PID 1 (or a subreaper), which a late look would take for the
    parent and outlive. Returns whether the kernel watches (Linux); the heartbeat checks
    in any case."""
    if parent is None:
        parent = environment.current().parent_pid
    if parent is None:
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
