"""Where training stands, in one object the runtime owns: :class:`StepState`.

The step pipeline (:mod:`paratrain.runtime.step`) is the only code that advances it; the
optimizer wrapper reads whether the next ``optimizer.step()`` applies the gradients, the stop
and the user's collectives read the step count and the last agreement, loaders tell it of
each training batch they hand out.

A micro-batch's loss weight and whether it ends the epoch travel with the batch
(:class:`~paratrain.data.loaders.BatchInfo`, an attribute of its tensors) and are taken when
the batch is *used*: at the first forward of the model after the previous micro-batch's
backward (or at ``rt.forward_backward``). A loop that takes batches ahead of use
(prefetching, ``list(loader)``, ``zip`` with a longer loader, ``itertools.islice``) therefore
trains the same model as the plain loop. A forward whose inputs carry no info (tensors the
loop made itself, e.g. ``x.float()``) takes the oldest batch handed out and not yet used.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from paratrain.data.loaders import PLAIN_BATCH, BatchInfo
from paratrain.runtime.agreement import StepAgreement

#: batches handed out and not yet used that are remembered (a loop that never trains on
#: what it takes must not grow this without bound)
_REMEMBERED = 4096


class StepState:
    """The optimizer-step count, the accumulation group, the micro-batch in hand and the
    step's agreement; advanced by the step pipeline only."""

    def __init__(self, accumulate: int = 1, agreement_seconds: float = 0.0) -> None:
        #: micro-batches per optimizer step
        self.accumulate = accumulate
        #: optimizer steps begun before the current one (a resumed loop sets its count)
        self.step = 0
        #: micro-batches whose gradients are summed since the last optimizer step
        self.micro_steps = 0
        #: backwards since the last ``optimizer.step()``, whatever ``accumulate`` says: a
        #: loop that accumulates by hand (``if step % 2 == 0: optimizer.step()``) has
        #: gradients no step applied yet, which a checkpoint must keep
        self.unapplied = 0
        #: whether the next ``optimizer.step()`` applies the gradients
        self.sync_gradients = True
        #: whether the last micro-batch's backward was skipped (a non-finite loss, ``skip``)
        self.skipped = False
        #: whether every micro-batch of the group that ended last was skipped (``skip``):
        #: its ``optimizer.step()`` applies no gradient
        self.group_skipped = False
        #: the micro-batch in hand: its loss weight, whether it ends the epoch
        self.batch: BatchInfo = PLAIN_BATCH
        #: what the micro-batch's loss is multiplied by before its backward (its loss weight
        #: over ``accumulate``), worked out when it begins
        self.loss_scale = PLAIN_BATCH.loss_weight / accumulate
        #: the step's one small all-reduce (:mod:`paratrain.runtime.agreement`)
        self.agreement = StepAgreement()
        self.agreement.seconds = agreement_seconds
        #: inside ``rt.join``: a rank that ran out of data takes no part in agreements
        self.local_only = False
        #: whether the micro-batch in hand began (its first forward, or its backward)
        self.begun = False
        self._handed: deque[BatchInfo] = deque(maxlen=_REMEMBERED)
        #: a loader hands a training batch out (:class:`~paratrain.data.loaders.BatchSink`):
        #: remembered until it is used, at the cost of no call of ours
        self.handed_out: Callable[[BatchInfo], None] = self._handed.append
        #: what settles the step's agreements (the step pipeline's settle), for epoch_done
        self.on_epoch_done: Callable[[], None] | None = None
        self._admitted = False  # some micro-batch of the group so far had its backward

    # -- what loaders tell (paratrain.data.loaders.BatchSink; handed_out above) --------------
    def epoch_done(self) -> None:
        """A loader's epoch ended: at the pace of ``agreement_seconds``, its last steps'
        checks are read now (a NaN raises at the end of the loop, not never)."""
        if self.agreement.seconds > 0 and self.on_epoch_done is not None:
            self.on_epoch_done()

    def restarted(self, source: int) -> None:
        """A loader starts an epoch: what it handed out before and nobody used is gone."""
        if any(info.source == source for info in self._handed):
            kept = [info for info in self._handed if info.source != source]
            self._handed.clear()  # the same deque: handed_out appends to it
            self._handed.extend(kept)

    # -- the micro-batch ---------------------------------------------------------------------
    def begin(self, info: BatchInfo | None) -> bool:
        """The micro-batch's first forward (or backward); ``info``: what its inputs carry.
        True when this call began it (later forwards of the same micro-batch change
        nothing)."""
        if self.begun:
            return False
        handed = self._handed
        if info is None:
            info = handed.popleft() if handed else PLAIN_BATCH
        elif handed and handed[0] is info:  # the batch handed out first: the plain loop's
            handed.popleft()
        else:
            self._forget(info)
        self.batch = info
        self.loss_scale = info.loss_weight / self.accumulate
        self.begun = True
        return True

    def _forget(self, info: BatchInfo) -> None:
        for index, held in enumerate(self._handed):
            if held is info:
                del self._handed[index]
                return

    @property
    def ends_group(self) -> bool:
        """Whether the micro-batch in hand ends its group (its gradients are synchronized
        and the next ``optimizer.step()`` applies them)."""
        return self.micro_steps + 1 >= self.accumulate or self.batch.ends_epoch

    def micro_batch_done(self) -> None:
        """After the micro-batch's backward (a skipped one too: on every rank alike)."""
        ends = self.ends_group
        self.begun = False
        self.batch = PLAIN_BATCH
        self.loss_scale = PLAIN_BATCH.loss_weight / self.accumulate
        self._admitted = self._admitted or not self.skipped
        self.unapplied += 1
        if ends:
            self.step += 1
            self.group_skipped = not self._admitted
            self._admitted = False
        if self.accumulate > 1:
            self.micro_steps += 1
            self.sync_gradients = ends

    def applied(self, *_: object) -> None:
        """``optimizer.step()`` applied the group's gradients (a step post-hook of an
        optimizer as the user built it: what the hook is given is not needed)."""
        self.micro_steps = 0
        self.unapplied = 0
        self.sync_gradients = self.accumulate == 1

    def resume_group(self, micro_steps: int, sync_gradients: bool) -> None:
        """A checkpoint saved ``micro_steps`` micro-batches into a group (their gradients
        restored), ``sync_gradients`` as it was then: the group goes on from there."""
        self.unapplied = micro_steps
        if self.accumulate > 1 and micro_steps > 0:
            self.micro_steps = micro_steps
            self.sync_gradients = sync_gradients
            self._admitted = True


class OptimizerSteps:
    """What one optimizer's ``step()`` calls did: how many there were and how many applied
    gradients (an LR scheduler handed to ``rt.setup`` advances only after those). Under a
    GradScaler, whether a step overflowed is a device flag read only when asked."""

    def __init__(self) -> None:
        self.calls = 0
        self._applied = 0
        self._overflowed: list[torch.Tensor] = []

    def called(self, applied: bool, overflowed: torch.Tensor | None = None) -> None:
        self.calls += 1
        self._applied += applied
        if applied and overflowed is not None:
            self._overflowed.append(overflowed)

    @property
    def applied(self) -> int:
        """Steps that applied gradients (reads the GradScaler's flags, a device sync)."""
        if self._overflowed:
            self._applied -= sum(int(flag.item()) for flag in self._overflowed)
            self._overflowed.clear()
        return self._applied
