"""From the process that trains to the Ray trial that reports.

Under ``ddp`` the main process of a run is a child that ``rt.launch`` spawned: it has no Ray
session and cannot call ``ray.tune.report`` itself. Its ``on_epoch`` callback is an
:class:`EpochLink`, one end of a pipe; the trial process holds the other end and reports.
The callback waits until the trial has reported (Ray has copied the epoch's checkpoint by
then), so training cannot remove that checkpoint first. In a one-process run both ends
are in the trial process, and the same code runs.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

#: sent back once the trial has reported an epoch
_ACK = "reported"


class EpochLink:
    """An ``on_epoch`` callback for ``loop.train`` that hands each epoch's figures to the
    trial process and waits for it to report them. Pickled into spawned processes with
    the connection it holds, so it can be passed through ``rt.launch``."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def __call__(self, record: dict[str, Any]) -> None:
        self.connection.send(record)
        # EOFError here: the trial process is gone (stopped early): stop training too.
        self.connection.recv()


class TrialBridge:
    """The trial process's end: runs the training in a thread, yields each epoch's record
    as it arrives, and acknowledges it once the caller has handled it."""

    def __init__(self) -> None:
        self._mine, theirs = multiprocessing.Pipe(duplex=True)
        self.link = EpochLink(theirs)
        self._error: BaseException | None = None
        self._result: Any = None

    def run(self, train: Callable[[EpochLink], Any], poll_seconds: float = 0.2) -> Iterator[Any]:
        """Call ``train(link)`` in a thread; yield every record it sends. Ends when it
        returns; re-raises what it raised. ``result`` holds what it returned."""

        def target() -> None:
            try:
                self._result = train(self.link)
            except BaseException as exc:  # handed to the trial thread below
                self._error = exc

        thread = threading.Thread(target=target, name="paratrain-trial", daemon=True)
        thread.start()
        while thread.is_alive() or self._mine.poll():
            if not self._mine.poll(poll_seconds):
                continue
            yield self._mine.recv()
            self._mine.send(_ACK)
        thread.join()
        if self._error is not None:
            raise self._error

    @property
    def result(self) -> Any:
        return self._result
