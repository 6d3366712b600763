"""How ``rt.launch`` starts the processes of one machine: forked from a process that has
imported torch already, instead of each process importing it anew.

A process that trains imports torch and, with its first optimizer, ``torch._dynamo``:
seconds of CPU each (about 5 s on a 2-core machine), paid by every process of every launch.
On Linux the processes are forked from multiprocessing's *fork server* instead, which
imported them once (:data:`PRELOAD`), so a launch after the first starts its processes in
a fraction of a second. The fork server is a clean process of its own (no threads, no
device initialized), which is what makes forking safe where forking the launcher is not.

Paratrain's own command line (``paratrain train``) is such a clean process when it launches:
it has run no parallel work and initialized no device. There the processes are forked from
the command itself, which spares the fork server's start (importing torch a second time:
about 4 s on a 2-core machine) — when it is still clean at that moment (one thread of
Python's, no more native threads than torch's import starts, CUDA not initialized);
otherwise from the server. A forked process starts its stop signals afresh
(:func:`paratrain.launching.preemption.reset`).

What a spawned process would have had, a forked one is given explicitly:

* the launcher's environment *now* (the server's is the one of when it started): the
  whole environment travels with the process's arguments and replaces its own
  (:func:`adopt`);
* standard output and error: the server's are the ones of when it started (another test's
  capture, a closed terminal); the launcher's descriptors travel with the process
  (multiprocessing's ``DupFd``) and take their place;
* the working directory and ``sys.path``: multiprocessing hands them on itself;
* the launcher's multiprocessing start method (``fork`` on Linux unless the program chose
  one): multiprocessing gives a process forked from the server the server's, and a
  DataLoader's workers would then start through a fork server of the rank's own, each
  importing the program's main module (torch with it) again, seconds per worker per epoch.

Libraries that read the environment when they load (OpenMP's ``OMP_WAIT_POLICY``) read
the server's: the launcher starts the server inside the first launch's environment
(:mod:`paratrain.launching.threads`); a later launch with another wait policy gets the
first one's, which changes the speed, never the weights. ``PARATRAIN_START_METHOD=spawn``
starts every process afresh instead (and is what other platforms do).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Mapping
from multiprocessing import reduction
from typing import Any

from paratrain.launching import preemption
from paratrain.utils import environment

START_METHOD_VARIABLE = "PARATRAIN_START_METHOD"
#: what the fork server imports once for every process it starts
PRELOAD = ["paratrain.launching.rank_preload"]


#: native threads of a clean process: its own and the one torch's import starts
_CLEAN_THREADS = 2
_fork_here = False


def fork_from_this_process() -> None:
    """Paratrain's command line says that its process may start the ranks itself (it runs
    no parallel work before it launches): see :func:`start_method`."""
    global _fork_here
    _fork_here = True


def start_method() -> str:
    """``fork`` from paratrain's command line while it is clean, else ``forkserver`` on
    Linux; ``spawn`` elsewhere, or any of them when ``PARATRAIN_START_METHOD`` asks."""
    asked = environment.current().get(START_METHOD_VARIABLE)
    if asked == "spawn" or not sys.platform.startswith("linux"):
        return "spawn"
    if asked in (None, "fork") and _fork_here and _clean():
        return "fork"
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"


def _clean() -> bool:
    """Whether forking this process is as safe as forking the server: no thread besides the
    main one (a thread's lock, or an OpenMP pool, would be copied half-alive) and no CUDA
    initialized (a forked process cannot use it)."""
    if threading.active_count() != 1:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    try:
        return len(os.listdir("/proc/self/task")) <= _CLEAN_THREADS
    except OSError:
        return False


class Inheritance:
    """What a forked process takes over from its launcher (picklable: it travels with the
    process's arguments; the descriptors are duplicated into the process on the way)."""

    def __init__(self, variables: Mapping[str, str], method: str) -> None:
        self.variables = dict(variables)
        #: the launcher's own choice, None for the platform's default
        self.start_method = multiprocessing.get_start_method(allow_none=True)
        self.streams: list[Any] = []
        for stream in (sys.stdout, sys.stderr) if method == "forkserver" else ():
            try:
                self.streams.append(_Descriptor(stream.fileno()))
            except (AttributeError, OSError, ValueError):  # no real descriptor (a capture)
                self.streams.append(None)

    def adopt(self) -> None:
        """In the new process: the launcher's environment, output and error streams."""
        environment.replace(self.variables)
        multiprocessing.set_start_method(self.start_method, force=True)
        for target, descriptor in zip((1, 2), self.streams, strict=False):
            if descriptor is not None:
                stream = sys.stdout if target == 1 else sys.stderr
                stream.flush()
                os.dup2(descriptor.detach(), target)
        if self.streams:  # forked from the server
            _let_the_server_end()
        # the fork server ignores SIGTERM (a signal to the launcher's process group must not
        # end it and, with it, every process it started), the command has its own handlers:
        # the process starts with Python's, and no stop requested (the runtime's come later)
        preemption.reset()
        for name in ("SIGTERM", "SIGUSR1"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _let_the_server_end() -> None:
    """Close this process's copy of the launcher's end of the server's *alive* pipe, which
    multiprocessing hands every process it forks: while one holds it, the server never sees
    its launcher end, and the processes it started (killed with the server,
    :mod:`paratrain.launching.parent_death`) would outlive a killed launcher."""
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(alive, int):
        with contextlib.suppress(OSError):
            os.close(alive)
        server._forkserver_alive_fd = None


class _Descriptor:
    """A file descriptor handed to the process being forked from the server
    (``reduction.DupFd``; a spawned process inherits the launcher's own)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __getstate__(self) -> dict[str, Any]:
        return {"dup": reduction.DupFd(self.fd)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._dup = state["dup"]

    def detach(self) -> int:
        return int(self._dup.detach())
