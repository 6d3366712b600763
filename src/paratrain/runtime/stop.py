"""The runtime's stop on a signal (``rt.should_stop``, ``rt.exit_stopped``): the request
the processes agreed on, kept between the two calls (:mod:`paratrain.launching.preemption`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from paratrain.launching import preemption
from paratrain.runtime.parts import RuntimeView
from paratrain.utils.errors import UserError


class StopOnSignal:
    """The stop the processes agreed on at the last ``rt.should_stop()``, if any."""

    def __init__(self, rt: RuntimeView) -> None:
        self.rt = rt
        self._stop: preemption.Request | None = None

    def agree(self) -> bool:
        self._stop = preemption.agree(self.rt.strategy.collective)
        return self._stop is not None

    def exit(self, checkpoint: str | os.PathLike[str] | None, step: int | None) -> NoReturn:
        request = self._stop or preemption.requested()
        if request is None:
            raise UserError("rt.exit_stopped() is for after rt.should_stop() returned True")
        path = None if checkpoint is None else Path(checkpoint)
        message = preemption.stop_message(request, step, path, time.time() - request.at)
        if self.rt.strategy.collective.is_main:
            print(message, file=sys.stderr, flush=True)
        self._stop = None
        preemption.clear()
        raise preemption.Stopped(request, message)
