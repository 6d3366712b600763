"""Stopping on a signal without losing work: SIGTERM (SLURM's time limit, Kubernetes, spot
reclaim), SIGUSR1 (``sbatch --signal=USR1@120``) and the first Ctrl-C (SIGINT).

:func:`watch` installs the handlers, in the main thread, the first time a process asks
:func:`agree` (``rt.should_stop()``): a loop that never asks keeps Python's own behaviour.
A handled signal only records a :class:`Request`; the loop asks at every optimizer step,
and the processes agree with one all-reduce of two float64 numbers (the signal's number and
minus the time it arrived), so one process's signal stops every process after the same
step, even when the others never saw it. A second SIGINT raises ``KeyboardInterrupt`` at
once. The loop then saves a checkpoint and raises :class:`Stopped`, whose exit code is 128
plus the signal's number (130 for Ctrl-C, 138 for SIGUSR1, 143 for SIGTERM), as a shell
reports a process killed by that signal: schedulers that retry such codes (Kubeflow's
``restartPolicy: ExitCode`` retries 128-255) retry it, and the one line printed says that
the checkpoint is complete.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Stopped is caught by the command line, which starts without torch
    from paratrain.distributed.collective import Collective

#: the signals that ask for a stop at the next step boundary
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


@dataclass(frozen=True)
class Request:
    """A stop asked for: which signal, and when (``time.time()``) it first arrived."""

    signum: int
    at: float

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Stopped(SystemExit):
    """Raised after a stop on a signal; the checkpoint (if any) is complete.

    A ``SystemExit``: a script that does not catch it ends quietly with :attr:`code`
    (128 + the signal's number); ``paratrain`` exits with that code too.
    """

    def __init__(self, request: Request, message: str) -> None:
        super().__init__(request.exit_code)
        self.request = request
        self.message = message


def stop_message(
    request: Request, step: int | None, checkpoint: Path | None, seconds: float
) -> str:
    """The one line a stop prints."""
    where = " before the first step" if step is None else f" after step {step}"
    saved = "nothing was saved" if checkpoint is None else f"checkpoint {checkpoint} is complete"
    return (
        f"paratrain: stopped by {request.name}{where}: {saved}, {seconds:.2f}s after the "
        f"signal; run the same command again to continue (exit code {request.exit_code})"
    )


_request: Request | None = None
_interrupts = 0
_watching = False
#: a loop or a launcher handles the stop signals now (see :func:`stop_before_start`)
_handled = False


def _handle(signum: int, frame: FrameType | None) -> None:
    global _request, _interrupts
    if signum == signal.SIGINT:
        _interrupts += 1
        if _interrupts > 1:  # a second Ctrl-C: stop now, whatever is being done
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
    if _request is None:
        _request = Request(signum, time.time())


def watch() -> bool:
    """Install the handlers (idempotent); False where signals cannot be handled here (not
    the main thread, as in a Ray Tune trial)."""
    global _watching
    if _watching:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    for name in STOP_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _handle)
    _watching = _handled = True
    return True


def requested() -> Request | None:
    """This process's own request, if a signal arrived."""
    return _request


def agree(collective: Collective) -> Request | None:
    """The stop every process agrees on, or None: one small all-reduce when there are
    several processes. Every process must call it at the same points. (The runtime carries
    the same two numbers in its step's all-reduce instead: :func:`local_values`, :func:`settle`.)"""
    watch()
    if collective.world_size == 1:
        return _request
    import torch

    values = torch.tensor(local_values(), dtype=torch.float64)
    signum, minus_at = collective.all_reduce(values, "max").tolist()
    return settle(signum, minus_at)


def local_values() -> tuple[float, float]:
    """This process's part of the agreement, reduced with max over the processes: the
    signal's number (0: none) and minus the time it arrived (the earliest wins)."""
    mine = _request
    return (float(mine.signum), -mine.at) if mine else (0.0, -math.inf)


def settle(signum: float, minus_at: float) -> Request | None:
    """The request the processes agreed on from :func:`local_values` reduced with max;
    a process that saw no signal takes it as its own."""
    global _request
    if signum == 0:
        return None
    if _request is None:
        _request = Request(int(signum), -minus_at)
    return Request(int(signum), -minus_at)


def clear() -> None:
    """Forget the request once acted on (the handlers stay): a later loop in this process
    runs until the next signal."""
    global _request, _interrupts
    _request, _interrupts = None, 0


def reset() -> None:
    """Forget a request and put Python's handlers back (tests; a process run again)."""
    global _request, _interrupts, _watching, _handled
    _request, _interrupts, _handled = None, 0, False
    if _watching and threading.current_thread() is threading.main_thread():
        for name in STOP_SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _watching = False


@contextlib.contextmanager
def forwarding(send: Callable[[int], None]) -> Iterator[list[Request]]:
    """A launcher's handlers while its processes run: each stop signal is passed on with
    ``send(signum)``; a second Ctrl-C also raises ``KeyboardInterrupt`` here. The list it
    yields holds the first signal received."""
    global _handled
    received: list[Request] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    _handled = True
    interrupts = [0]

    def handle(signum: int, frame: FrameType | None) -> None:
        if not received:
            received.append(Request(signum, time.time()))
        send(signum)
        if signum == signal.SIGINT:
            interrupts[0] += 1
            if interrupts[0] > 1:
                raise KeyboardInterrupt

    names = [name for name in STOP_SIGNALS if hasattr(signal, name)]
    before = {name: signal.signal(getattr(signal, name), handle) for name in names}
    try:
        yield received
    finally:
        for name, handler in before.items():
            signal.signal(getattr(signal, name), handler)


def stop_before_start(speaks: Callable[[], bool]) -> None:
    """From a command's first line until a loop or a launcher handles them: SIGTERM or
    SIGUSR1 end the command with its one line, "stopped by SIG... before the first step"
    (printed where ``speaks()``), and its exit code, instead of dying without a word."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop_now(signum: int, frame: FrameType | None) -> None:
        if _handled:  # the loop or the launcher has had its turn: as if never handled
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        request = Request(signum, time.time())
        message = stop_message(request, None, None, 0.0)
        if speaks():
            print(message, file=sys.stderr, flush=True)
        raise Stopped(request, message)

    for name in ("SIGTERM", "SIGUSR1"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), stop_now)
