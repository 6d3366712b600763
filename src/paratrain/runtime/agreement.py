"""The one small all-reduce of a training step: everything the processes must agree on
before the backward pass, in one tensor of ten float64 numbers.

Three agreements meet at that point of a step, and each used to cost an all-reduce of its
own: whether a loss was NaN or infinite (:mod:`paratrain.runtime.nonfinite`), whether a
process ran out of memory in its forward (``--oom auto``, :mod:`paratrain.runtime.oom`),
and whether a signal asked for a stop (:mod:`paratrain.launching.preemption`, read by
``rt.should_stop()`` after the step). They travel together, reduced with ``max``:

======  ==========================================================================
0, 1    a marker and minus it: a process whose part is not this agreement shows
2, 3    the step and minus it: every process is at the same step (max == -max(-x))
4       a process saw a non-finite loss
5, 6    a process ran out of memory; the largest piece's samples
7, 8    the stop: the signal's number, minus the time it arrived (earliest wins)
9       ``pipeline``: the batch's loss, from the last stage (-inf from the others)
======  ==========================================================================

A stop rides along with whatever agreement comes first; ``rt.should_stop()`` then reads the
last one instead of running its own all-reduce. A signal that arrives after a step's
agreement is therefore acted on one step later, on every process alike; only a
``should_stop()`` with no agreement since the previous one (before the first step, or a
loop without ``rt.backward``) runs an agreement of its own. Who saw which non-finite loss
or ran out of memory is asked only when one did (a second collective, rare). Under
``pipeline`` the step's agreement comes after its forward and backward (they run together)
and also hands every process the last stage's loss, which used to be one more all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paratrain.distributed.collective import Collective
from paratrain.launching import preemption
from paratrain.utils.errors import LaunchError

_MARKER = 7919.0  # a prime: unlikely to be what an unrelated collective holds there
#: the step of an agreement before one of the user's collectives, and of rt.should_stop's own
BEFORE_COLLECTIVE = -1
BEFORE_STOP = -2


@dataclass(frozen=True)
class Verdict:
    """What the processes agreed on."""

    #: some process saw a non-finite loss
    bad: bool = False
    #: some process ran out of memory, and the largest piece it was given
    failed: bool = False
    samples: int = 0
    #: the stop a signal asked for, if any
    stop: preemption.Request | None = None
    #: the finite value one process gave (a pipeline's loss); -inf if none did
    value: float = -math.inf


class StepAgreement:
    """The agreements of one runtime; counts them so that ``rt.should_stop()`` knows
    whether one carried the stop since its last call (the same count on every process)."""

    def __init__(self) -> None:
        #: agreements among several processes so far
        self.count = 0
        #: the stop agreed on at the last one
        self.stop: preemption.Request | None = None

    def exchange(
        self,
        collective: Collective,
        step: int,
        here: str,
        bad: torch.Tensor | None = None,
        failed: bool = False,
        samples: int = 0,
        value: torch.Tensor | None = None,
    ) -> Verdict:
        """One all-reduce (none for one process). ``bad``: this process's non-finite flag,
        on its device (no sync before the collective); ``here``: where this process is, for
        the message when the processes are not all at the same point; ``value``: a number
        that only this process has (one process gives it; a non-finite one is not passed)."""
        if collective.world_size == 1:
            found = -math.inf if value is None else value.item()
            return Verdict(
                bad is not None and bool(bad),
                failed,
                samples,
                preemption.requested(),
                found if math.isfinite(found) else -math.inf,
            )
        signum, minus_at = preemption.local_values()
        values = [_MARKER, -_MARKER, float(step), -float(step), 0.0]
        values += [float(failed), float(samples), signum, minus_at, -math.inf]
        place = bad if bad is not None else value
        device = None if place is None else place.device
        known = torch.tensor(values, dtype=torch.float64, device=device)
        if bad is not None:
            known[4] = bad.to(torch.float64)  # stays on the device
        if value is not None:  # max would be undefined with a NaN: -inf stands for it
            finite = value.detach().to(torch.float64)
            known[9] = torch.where(torch.isfinite(finite), finite, -math.inf)
        told: list[float] = collective.all_reduce(known, "max").tolist()
        if told[:4] != [_MARKER, -_MARKER, float(step), -float(step)]:
            raise LaunchError(
                f"rank {collective.rank} is {here}, but not every rank is: the ranks ran "
                "different numbers of batches. Give every rank the same number of batches "
                "(rt.setup_loader does), or wrap the loop in `with rt.join(model):`"
            )
        self.count += 1
        self.stop = preemption.settle(told[7], told[8])
        return Verdict(told[4] > 0, told[5] > 0, int(told[6]), self.stop, told[9])
