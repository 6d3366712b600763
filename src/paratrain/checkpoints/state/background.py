"""Checkpoints written off the training loop's critical path.

The loop copies what a checkpoint holds to the CPU (cheap, synchronous: later steps cannot
change it) and hands the writing to one background thread, then trains on. Writing follows
the same crash-safe protocol as before (:mod:`.store`: hidden temporary directory, flushed,
renamed into place), so a crash at any moment still leaves only complete checkpoints.

One write at a time: the next checkpoint, and the end of training, wait for the previous
write first, so checkpoints appear in step order, pruning never races a write, and a run
reported finished has all its checkpoints on disk. An error of the background write is
raised there, in the training thread.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

_IMMUTABLE = (int, float, str, bool, bytes, type(None))


def detached_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU and every container rebuilt, so that
    training on cannot change it (a CPU tensor is copied too: ``.cpu()`` would share it)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((key, detached_copy(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(detached_copy(value) for value in obj)
    if isinstance(obj, _IMMUTABLE):
        return obj
    return copy.deepcopy(obj)


class BackgroundWriter:
    """Runs one job at a time on a thread; :meth:`wait` joins it and re-raises its error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: seconds the jobs took in the background
        self.seconds = 0.0

    def submit(self, job: Callable[[], Any]) -> None:
        """Wait for the previous job (raising its error), then start ``job``."""
        self.wait()
        # Not a daemon: a write under way when training ends or fails still completes.
        self._thread = threading.Thread(target=self._run, args=(job,), name="paratrain-checkpoint")
        self._thread.start()

    def _run(self, job: Callable[[], Any]) -> None:
        start = time.perf_counter()
        try:
            job()
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc
        finally:
            self.seconds += time.perf_counter() - start

    def wait(self) -> None:
        """Block until the job under way is done; raise the error it ended with."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
