"""The one small all-reduce of a training step: everything the processes must agree on
before the backward pass, in one tensor of thirteen float64 numbers.

Three agreements meet at that point of a step, and each used to cost an all-reduce of its
own: whether a loss was NaN or infinite (:mod:`paratrain.runtime.nonfinite`), whether a
process ran out of memory in its forward (``--oom auto``, :mod:`paratrain.runtime.oom`),
and whether a signal asked for a stop (:mod:`paratrain.launching.preemption`, read by
``rt.should_stop()`` after the step). They travel together, reduced with ``max``, in the
named slots of :data:`SLOTS` (:class:`Proposal` writes a process's message, :class:`Told`
reads the reduced one by name):

======  ==========================================================================
0, 1    a marker and minus it: a process whose part is not this agreement shows
2, 3    the step and minus it: every process is at the same step (max == -max(-x))
4       a process saw a non-finite loss
5, 6    a process ran out of memory; the largest piece's samples
7, 8    the stop: the signal's number, minus the time it arrived (earliest wins)
9       ``pipeline``: the batch's loss, from the last stage (-inf from the others)
10, 11  before a collective: a fingerprint of the call and minus it (every process in the
        same call, with the same tensor: :mod:`paratrain.runtime.call_check`)
12      the main process's pace: optimizer steps until the next agreement (see below)
======  ==========================================================================

A stop rides along with whatever agreement comes first; ``rt.should_stop()`` then uses the
last one read instead of running its own all-reduce. On the quiet path (the default: the
``error`` policy, no ``--oom auto``) a step's agreement is started before its backward and
read at the next step's, so a step never waits for its own all-reduce: on gloo it travels on
gloo's threads while the backward runs, on NCCL on the collective's stream, and its host copy
is made without waiting for the device. On the batches of ``rt.setup_loader`` (the same
number on every process) the quiet path does not even agree at every step: the main process
proposes a pace in each agreement (slot 12: the optimizer steps that make
``agreement_seconds`` at the speed of the last ones), every process reads it at the same
step, and the next agreement is due then (or at the epoch's end); each process keeps its
losses since the last one on its device meanwhile, computing nothing from them until then
(:class:`paratrain.runtime.nonfinite.Kept`). On a CPU machine a small
all-reduce costs about a millisecond, a fifth of a small model's step. A non-finite loss
therefore stops every process by the next agreement (its message names the step of the
first one), and a signal is acted on one step after the agreement that carried it;
``rt.save``, ``rt.save_weights``, ``rt.settle``, the runtime's collectives and the
program's end read every agreement first, so nothing is written from a step with a
non-finite loss. Only a
``should_stop()`` with no training step since the previous one (before the first step,
after an evaluation, a loop without ``rt.backward``) runs one of its own.
Who saw which non-finite loss or ran out of memory is asked only when one did (a second
collective, rare). Under
``pipeline`` the step's agreement comes after its forward and backward (they run together)
and also hands every process the last stage's loss, which used to be one more all-reduce.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.distributed.collective import Collective, Reduction
from paratrain.launching import preemption
from paratrain.utils.errors import LaunchError

#: optimizer steps between two agreements at most, however fast the steps
MAX_PACE = 1000
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
    #: every process brought the same call fingerprint
    same_call: bool = True


#: the message's slots, in order (all float64, reduced with max)
SLOTS = (
    "marker",
    "minus_marker",
    "step",
    "minus_step",
    "bad",
    "failed",
    "samples",
    "signum",
    "minus_at",
    "value",
    "call",
    "minus_call",
    "pace",
)
_AT = {name: index for index, name in enumerate(SLOTS)}


@dataclass(frozen=True)
class Proposal:
    """What one process brings to the agreement (its flags on the host; the non-finite flag
    and the pipeline's loss stay on the device until the all-reduce)."""

    step: int
    failed: bool = False
    samples: int = 0
    signum: float = 0.0
    minus_at: float = -math.inf
    call: int = 0
    pace: int = 0

    def encode(self, bad: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor:
        slots = dict.fromkeys(SLOTS, 0.0)
        slots.update(marker=_MARKER, minus_marker=-_MARKER, step=self.step, minus_step=-self.step)
        slots.update(failed=float(self.failed), samples=float(self.samples))
        slots.update(signum=self.signum, minus_at=self.minus_at, value=-math.inf)
        slots.update(call=float(self.call), minus_call=-float(self.call), pace=float(self.pace))
        place = bad if bad is not None else value
        device = None if place is None else place.device
        message = torch.tensor([slots[name] for name in SLOTS], dtype=torch.float64, device=device)
        if bad is not None:
            message[_AT["bad"]] = bad.to(torch.float64)  # stays on the device
        if value is not None:  # max would be undefined with a NaN: -inf stands for it
            finite = value.detach().to(torch.float64)
            message[_AT["value"]] = torch.where(torch.isfinite(finite), finite, -math.inf)
        return message


@dataclass(frozen=True)
class Told:
    """The reduced message, read back by name."""

    marker: float
    minus_marker: float
    step: float
    minus_step: float
    bad: bool
    failed: bool
    samples: int
    signum: float
    minus_at: float
    value: float
    call: float
    minus_call: float
    pace: float

    @classmethod
    def decode(cls, values: list[float]) -> Told:
        named: dict[str, Any] = dict(zip(SLOTS, values, strict=True))
        named.update(bad=named["bad"] > 0, failed=named["failed"] > 0)
        named["samples"] = int(named["samples"])
        return cls(**named)

    def same_point(self, step: int) -> bool:
        """Every process brought this message, at this step (max == -max(-x))."""
        return (self.marker, -self.minus_marker, self.step, -self.minus_step) == (
            _MARKER,
            _MARKER,
            float(step),
            float(step),
        )


class HostCopy:
    """A small all-reduce's values on the host, read only when asked: on CUDA copied into
    pinned memory behind an event (the host never waits for the device to make it); on the
    CPU the all-reduce itself is waited for then (gloo runs it on its own threads while
    this process goes on with the backward)."""

    def __init__(self, reduction: Reduction) -> None:
        self._event: Any = None
        self._reduction: Reduction | None = reduction
        self._host: torch.Tensor | None = None
        if reduction.device.type == "cuda":
            tensor = reduction.result()  # the stream waits for the collective, not the host
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._reduction = None

    def values(self) -> list[float]:
        if self._reduction is not None:  # the CPU (MPS: read when asked)
            self._host, self._reduction = self._reduction.result(), None
        elif self._event is not None:
            self._event.synchronize()
        assert self._host is not None
        return _listed(self._host)


def _listed(tensor: torch.Tensor) -> list[float]:
    """A tensor's values on the host, as a list (a 0-d tensor's ``tolist`` gives a number)."""
    values = tensor.tolist()
    return values if isinstance(values, list) else [values]


def _host_values(copy: HostCopy | torch.Tensor) -> list[float]:
    """What was sent, on the host (a tensor of the CPU is read as it is)."""
    return copy.values() if isinstance(copy, HostCopy) else _listed(copy)


@dataclass(slots=True)
class _Sent:
    """An agreement sent and not read yet (not changed once made: one is made at every
    step, and a ``frozen`` record costs five times more to make)."""

    step: int
    rank: int
    world_size: int
    #: the all-reduce's values on their way to the host; one process off CUDA: its kept
    #: losses themselves, read as they are
    copy: HostCopy | torch.Tensor
    #: what is told whether some process saw a non-finite loss, once read (the non-finite
    #: policy's judgement)
    on_read: Callable[[bool], object]


class StepAgreement:
    """The agreements of one runtime; counts them so that ``rt.should_stop()`` knows
    whether one carried the stop since its last call (the same count on every process).

    On the quiet path (nothing to decide before the backward: the ``error`` policy for
    non-finite losses, no ``--oom auto``) a step's agreement is *sent* (:meth:`send`) and
    read later (:meth:`settle`): at the next step's agreement, at ``rt.should_stop()`` (which
    reads all but the newest), before a checkpoint, the final weights or any of the runtime's
    collectives. The host never waits for the device inside a step."""

    def __init__(self) -> None:
        #: agreements among several processes read so far
        self.count = 0
        #: agreements begun (sent or exchanged), whether read yet or not
        self.begun = 0
        #: the stop agreed on at the last one
        self.stop: preemption.Request | None = None
        self._sent: deque[_Sent] = deque()
        #: seconds between two agreements of the quiet path (0: every optimizer step)
        self.seconds = 0.0
        #: the optimizer step (1-based) whose agreement is the next one due
        self.next_at = 0
        #: the main process: when and at which step it sent the last one
        self._paced_from: tuple[float, int] | None = None
        #: the last optimizer step an agreement was begun at (paced: steps after it wait)
        self.agreed_through = 0

    def behind(self, step: int) -> bool:
        """Whether optimizer steps up to ``step`` were taken since the last agreement (the
        quiet path's pace): their checks are still on each process's device."""
        return self.seconds > 0 and step > self.agreed_through

    def due(self, step: int) -> bool:
        """Whether the quiet path's agreement is due at optimizer step ``step``: every step,
        or, with ``seconds`` set, at the step the main process's pace named (the same on
        every process: it travels in the agreement, read at the same step everywhere)."""
        return self.seconds <= 0 or step >= self.next_at

    def _pace(self, rank: int, step: int) -> int:
        """The main process's proposal: how many optimizer steps make ``seconds`` at the
        speed of the steps since the last agreement (the others propose 0)."""
        if rank != 0 or self.seconds <= 0:
            return 0
        now = time.monotonic()
        last, self._paced_from = self._paced_from, (now, step)
        if last is None or step <= last[1]:
            return 1
        per_step = max(now - last[0], 1e-9) / (step - last[1])
        return max(1, min(MAX_PACE, int(self.seconds / per_step)))

    @property
    def waiting(self) -> bool:
        """Whether an agreement was sent and not read yet."""
        return bool(self._sent)

    def send(
        self,
        collective: Collective,
        step: int,
        bad: torch.Tensor,
        on_read: Callable[[bool], object],
    ) -> None:
        """The all-reduce of :meth:`exchange` at training step ``step`` (none for one
        process), read later: ``on_read`` is told whether some process saw a non-finite loss
        when :meth:`settle` reads it. ``bad``: this process's non-finite flag on its device;
        for one process, the losses themselves (read on the host, where a non-finite one is
        bad: no operation on the device)."""
        if self._sent:
            self.settle(collective)  # the previous step's, whose all-reduce ended long ago
        self.begun += 1
        if step > self.agreed_through:
            self.agreed_through = step
        copy: HostCopy | torch.Tensor
        if collective.world_size == 1:
            # nothing to reduce; on CUDA copied to the host behind an event, else read as is
            copy = HostCopy(Reduction(bad)) if bad.is_cuda else bad
        else:
            signum, minus_at = preemption.local_values()
            pace = self._pace(collective.rank, step)
            proposal = Proposal(step, signum=signum, minus_at=minus_at, pace=pace)
            copy = HostCopy(collective.start_all_reduce(proposal.encode(bad, None), "max"))
        self._sent.append(_Sent(step, collective.rank, collective.world_size, copy, on_read))

    def settle(self, collective: Collective, newest: bool = True) -> None:
        """Read what was sent: everything, or all but the newest (``newest=False``)."""
        sent_so_far = self._sent
        while sent_so_far and (newest or len(sent_so_far) > 1):
            sent = sent_so_far.popleft()
            values = _host_values(sent.copy)
            if sent.world_size == 1:
                sent.on_read(not all(map(math.isfinite, values)))
                continue
            here = f"at training step {sent.step}"
            sent.on_read(self._told(Told.decode(values), sent.step, here, sent.rank).bad)

    def exchange(
        self,
        collective: Collective,
        step: int,
        here: str,
        bad: torch.Tensor | None = None,
        failed: bool = False,
        samples: int = 0,
        value: torch.Tensor | None = None,
        call: int = 0,
    ) -> Verdict:
        """One all-reduce (none for one process), read at once. ``bad``: this process's
        non-finite flag, on its device (no sync before the collective); ``here``: where this
        process is, for the message when the processes are not all at the same point;
        ``value``: a number that only this process has (one process gives it; a non-finite
        one is not passed)."""
        self.settle(collective)
        self.begun += 1
        self.agreed_through = max(self.agreed_through, step)
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
        mine = Proposal(step, failed, samples, signum, minus_at, call)
        told = Told.decode(collective.all_reduce(mine.encode(bad, value), "max").tolist())
        return self._told(told, step, here, collective.rank)

    def _told(self, told: Told, step: int, here: str, rank: int) -> Verdict:
        if not told.same_point(step):
            raise LaunchError(_out_of_step(told, rank, here))
        self.count += 1
        if step > 0 and told.pace > 0:  # a training step's: the next one is due then
            self.next_at = step + int(told.pace)
        self.stop = preemption.settle(told.signum, told.minus_at)
        same_call = told.call == -told.minus_call
        return Verdict(told.bad, told.failed, told.samples, self.stop, told.value, same_call)


def _out_of_step(told: Told, rank: int, here: str) -> str:
    """Why the processes are not at the same point: a rank still training while another is
    in a collective is either out of batches or past a rank guard."""
    lowest, highest = -told.minus_step, told.step
    if told.same_point(int(told.step)) or lowest >= 0 or highest < 0:  # all in steps
        return (
            f"rank {rank} is {here}, but not every rank is: the ranks ran different numbers "
            "of batches. Give every rank the same number of batches (rt.setup_loader does), "
            "or wrap the loop in `with rt.join(model):`"
        )
    return (
        f"rank {rank} is {here}, but another rank is still in a training step: either a call "
        "every rank must make (rt.all_reduce, rt.barrier, rt.save...) is under a rank guard "
        "such as `if rank == 0:` (remove the guard), or the ranks ran different numbers of "
        "batches (give every rank the same number, or wrap the loop in `with rt.join(model):`)"
    )
