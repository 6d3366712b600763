"""The runtime's stop on a signal (``rt.should_stop``, ``rt.exit_stopped``): the request
the processes agreed on, kept between the two calls (:mod:`paratrain.launching.preemption`).
Under several processes the agreement is the one the step already ran (its one small
all-reduce, :mod:`paratrain.runtime.agreement`); only a call with none since the previous one
runs its own."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from paratrain.launching import preemption
from paratrain.runtime.agreement import BEFORE_STOP
from paratrain.runtime.parts import RuntimeParts
from paratrain.utils.errors import UserError


class StopOnSignal:
    """The stop the processes agreed on at the last ``rt.should_stop()``, if any."""

    def __init__(self, rt: RuntimeParts) -> None:
        self.rt = rt
        self._stop: preemption.Request | None = None
        self._seen = 0  # the agreements begun at the last call
        self._seen_step = 0  # the optimizer steps taken at the last call

    def agree(self) -> bool:
        collective = self.rt.strategy.collective
        if collective.world_size == 1:
            self._stop = preemption.agree(collective)
            return self._stop is not None
        preemption.watch()  # the first call installs the handlers
        agreement, step = self.rt.state.agreement, self.rt.state.step
        if agreement.begun == self._seen and step == self._seen_step:
            # no training step since the last call (before the first, after an evaluation,
            # a loop without rt.backward): an agreement of its own
            here = f"in rt.should_stop after {step} training steps"
            agreement.exchange(collective, BEFORE_STOP, here)
        # else the steps' agreements carry the stop (paratrain.runtime.agreement), every step
        # or at the main process's pace; the newest is read at the next step, so that the
        # host never waits for the device here
        self._seen, self._seen_step = agreement.begun, step
        self._stop = agreement.stop
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
        self.rt.state.agreement.stop = None  # acted on: a later loop runs on
        preemption.clear()
        raise preemption.Stopped(request, message)
