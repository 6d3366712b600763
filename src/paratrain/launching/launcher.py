"""What every launcher of paratrain shares (``rt.launch``'s spawn,
:mod:`~paratrain.launching.launch`; torchrun's agent, :mod:`~paratrain.launching.agent`),
and what each of their ranks does when it fails.

A :class:`Launcher` makes the run's folder, gives its processes their environment (the
folder for reports and heartbeats, its own pid), watches them for hangs, and turns what
they reported (:mod:`paratrain.utils.reports`) into one error or one stop. The rank side
is :func:`report_failure` and :func:`report_stop`: one report per rank, whichever launcher
started it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import tempfile
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from paratrain.distributed.once import tell_once
from paratrain.launching.preemption import Request, Stopped, stop_message
from paratrain.launching.watchdog import Watchdog, hang_timeout
from paratrain.utils import environment
from paratrain.utils.environment import (
    HEARTBEAT_DIR_VARIABLE,
    PARENT_VARIABLE,
    REPORT_DIR_VARIABLE,
)
from paratrain.utils.errors import LaunchError, UserError
from paratrain.utils.reports import ReportFolder, exit_code, kind_of


class Launcher(ABC):
    """Starts a run's processes and waits for them; one error (or stop) when they fail."""

    #: the run's folder (reports, heartbeats) while :meth:`folder` is open
    reports: ReportFolder
    #: the hang watchdog, None when ``--hang-timeout 0``
    watchdog: Watchdog | None
    #: the watchdog's timeout given by the caller (None: ``PARATRAIN_HANG_TIMEOUT`` or the
    #: default; 0: off)
    hang_seconds: float | None = None

    @abstractmethod
    def start(self, *args: Any) -> Any:
        """Run the processes to their end; their result, or one error."""

    @contextlib.contextmanager
    def folder(self, prefix: str) -> Iterator[Path]:
        """The run's folder, removed afterwards."""
        given = self.hang_seconds
        timeout = hang_timeout() if given is None else given or None
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            self.reports = ReportFolder(tmp)
            self.watchdog = Watchdog(Path(tmp), timeout) if timeout is not None else None
            yield Path(tmp)

    def child_environment(self, parent: bool = True) -> dict[str, str]:
        """What this launcher's processes get in their environment (besides their rank);
        ``parent``: its pid too, for processes that look for their launcher themselves."""
        variables = {REPORT_DIR_VARIABLE: str(self.reports.directory)}
        if parent:
            variables[PARENT_VARIABLE] = str(os.getpid())
        if self.watchdog is not None:
            variables[HEARTBEAT_DIR_VARIABLE] = str(self.reports.directory)
        return variables

    def stopped(self) -> Stopped | None:
        """The stop the processes acted on (rank 0 printed its line), or None."""
        saved = self.reports.stop()
        if saved is None:
            return None
        request = Request(int(saved["signum"]), float(saved["at"]))
        return Stopped(request, str(saved["message"]))


def stopped_early(request: Request) -> BaseException:
    """A signal that ended the processes before their loop could save anything: its line,
    and what the launcher ends with."""
    if request.name == "SIGINT":
        return KeyboardInterrupt()
    message = stop_message(request, None, None, max(time.time() - request.at, 0.0))
    print(message, file=sys.stderr, flush=True)
    return Stopped(request, message)


# -- the rank's side ---------------------------------------------------------------------


def reporting() -> bool:
    """Whether a paratrain launcher reads this rank's reports."""
    return environment.current().report_dir is not None


def report_started() -> None:
    env = environment.current()
    if env.report_dir is not None:
        ReportFolder(env.report_dir).started(env.attempt, env.rank, os.getpid())


def report_failure(exc: BaseException, message: str | None = None) -> int | None:
    """Hand ``exc`` (said as ``message``, else its text or, for a crash, the traceback) to
    the launcher; the rank's exit code, or None where no paratrain launcher reads reports.

    This process dies of ``exc``: recorded as the interpreter does for an uncaught
    exception, so that the runtime's exit handler leaves the group without waiting for
    peers that may be gone.
    """
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    env = environment.current()
    if env.report_dir is None:
        return None
    kind = kind_of(exc)
    if message is None:
        message = "".join(traceback.format_exception(exc)) if kind == "crash" else str(exc)
    ReportFolder(env.report_dir).failed(env.attempt, env.rank, kind, message)
    return exit_code(kind)


def report_stop(stop: Stopped) -> bool:
    """Rank 0 leaves the stop it acted on for the launcher to exit with; False where no
    paratrain launcher reads reports."""
    env = environment.current()
    if env.report_dir is None:
        return False
    if env.is_rank_zero:
        request = {"signum": stop.request.signum, "at": stop.request.at, "message": stop.message}
        ReportFolder(env.report_dir).stopped(env.attempt, request)
    return True


def say_one_line(exc: UserError | LaunchError) -> int:
    """Hand a one-line error to the launcher (or, under plain torchrun, print it once: the
    first process to get there says it); the exit code."""
    code = report_failure(exc)
    if code is not None:
        return code
    if tell_once("error"):
        print(f"paratrain: error: {exc}", file=sys.stderr, flush=True)
    return exit_code(kind_of(exc))


def leave_now(code: int | None, exit_handlers: bool = False) -> NoReturn:
    """Exit with ``code`` (None: 1) at once, streams flushed, after a one-line error every
    process says alike: the interpreter's own exit would run the C++ destructors of a
    process group whose peers are gone, and gloo's threads then end the process with
    "terminate called without an active exception" and SIGABRT, after the line that said
    why. ``exit_handlers``: the program's ``atexit`` handlers run first (a crash reported
    to torchrun's agent: the user's logger still flushes). (Under ``rt.launch`` a crash keeps
    the interpreter's exit: torch.multiprocessing carries its traceback to the parent.)"""
    if exit_handlers:
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1 if code is None else code)


def at_healthy_exit(check: Callable[[], None]) -> None:
    """Run ``check`` when the interpreter exits after the program ended well (no uncaught
    exception), before the process group is left (exit handlers run newest first); a
    one-line error it raises is said and the process exits with its code."""

    def run() -> None:
        if getattr(sys, "last_value", None) is not None:
            return
        try:
            check()
        except (UserError, LaunchError) as exc:
            leave_now(say_one_line(exc))

    atexit.register(run)
