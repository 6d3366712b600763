"""Non-finite losses: every rank stops (or skips) at the same step, and one message names the
rank and the step.

The step pipeline (:mod:`paratrain.runtime.step`) looks at every micro-batch's loss before
its backward pass (:meth:`NonFiniteCheck.look`, then :meth:`NonFiniteCheck.settle`). Once per
optimizer step (before the backward of the micro-batch that ends it, so before the gradients
are all-reduced) the ranks agree with one all-reduce of a few
float64 numbers: a marker, whether a rank saw a non-finite loss, and the step, in the step's
one small all-reduce, which ``--oom auto`` and ``rt.should_stop()`` share
(:mod:`paratrain.runtime.agreement`). That is the cost of the check: one small collective
per optimizer step (and, on a GPU, reading it back). Only when a rank saw one does a second
collective find which ranks.

Policies (the runtime's configuration: ``--skip-nonfinite``, or ``PARATRAIN_NONFINITE``):

* ``error`` (default): every rank raises :class:`~paratrain.utils.errors.NonFiniteLossError`;
* ``skip``: every rank skips that micro-batch's backward (the step then applies no gradient
  from it; with ``zero_grad(set_to_none=True)``, the default, a one-micro-batch step changes
  nothing), and the main process notes it. Each micro-batch is agreed on, not each step;
* ``off``: no check and no collective.

Only the loss is checked, not the gradients: under fp16 a GradScaler skips steps whose
scaled gradients overflowed, by design, and that is not an error.

The marker and the step also catch ranks that reached different points of training
(different numbers of batches, in a user's own loop): ``rt.all_reduce``, ``rt.all_gather``,
``rt.broadcast_object`` and ``rt.barrier`` first run the same small all-reduce with a step of
-1 (:mod:`paratrain.runtime.collectives`). A rank that ran out of batches and goes on to such a
collective meets a rank still training at its step check; both see the mismatch and fail
with one message, instead of pairing unrelated collectives (which gloo may turn into an
abort, or into a hang).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paratrain.distributed.collective import Collective
from paratrain.utils.errors import NonFiniteLossError, UserError

#: the variable the runtime configuration reads the default policy from
POLICY_VARIABLE = "PARATRAIN_NONFINITE"
POLICIES = ("error", "skip", "off")


@dataclass(slots=True)
class Kept:
    """The losses this process looked at since the last agreement, newest first, detached
    and left on their device: a micro-batch that does not agree costs no tensor operation,
    and only an agreement computes from them (on the device, no sync). Not changed once
    made (a record of every step: ``slots``, not ``frozen``, whose making costs five times
    more)."""

    step: int
    loss: torch.Tensor
    earlier: Kept | None = None

    def entries(self) -> list[Kept]:
        """Oldest first."""
        found: list[Kept] = []
        kept: Kept | None = self
        while kept is not None:
            found.append(kept)
            kept = kept.earlier
        found.reverse()
        return found

    def losses(self) -> torch.Tensor:
        """The kept losses in one tensor (the only one as it is: no operation)."""
        if self.earlier is None:
            return self.loss
        return torch.stack([kept.loss.reshape(()) for kept in self.entries()])

    def flag(self) -> torch.Tensor:
        """1.0 where a kept loss is NaN or infinite, else 0.0 (float64, on the device)."""
        return torch.isfinite(self.losses()).all().logical_not().double()

    def first_bad_step(self) -> int:
        """The step of the first non-finite kept loss, 0 if none: reads each loss on the
        host (only once the processes agreed that one was bad)."""
        for kept in self.entries():
            if not math.isfinite(float(kept.loss)):
                return kept.step
        return 0


@dataclass(slots=True)
class Look:
    """One micro-batch's loss seen by this process alone, before the processes agree (not
    changed once made)."""

    #: this process's non-finite flag, to agree on now, on its device (None: nothing to
    #: agree on); on the quiet path of one process, the kept losses themselves
    bad: torch.Tensor | None = None
    #: the losses looked at since the last agreement, this one included, kept for the
    #: micro-batch that agrees (None: none)
    kept: Kept | None = None


#: a look that kept nothing and has nothing to agree on (one made at every step of one
#: process on the CPU: shared)
NOTHING_SEEN = Look()


class NonFiniteCheck:
    """Whether a loss was finite, judged on every process alike (the policy's answer); the
    step pipeline (:mod:`paratrain.runtime.step`) runs it, the step's agreement carries it."""

    def __init__(self, policy: str = "error") -> None:
        """``policy``: the runtime configuration's ``nonfinite`` option (which reads
        ``PARATRAIN_NONFINITE`` when it is built)."""
        self.policy = policy
        if self.policy not in POLICIES:
            raise UserError(f"non-finite policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        self._kept: Kept | None = None  # losses since the last agreement

    def look(
        self,
        loss: torch.Tensor,
        collective: Collective,
        step: int,
        ends_step: bool,
        local_only: bool = False,
        deferred: bool = False,
    ) -> Look:
        """This process's part: changes nothing until :meth:`settle` (a piece that ran out
        of memory somewhere is redone and looked at again). ``local_only``: inside
        ``rt.join``, where a rank that ran out of data takes no part in an agreement;
        ``deferred``: the verdict is read later, so a loss on a device is not read here
        either (one process on the CPU reads its loss at once: nothing to wait for)."""
        if self.policy == "off":
            return NOTHING_SEEN
        if collective.world_size == 1 and self._kept is None and loss.is_cpu:
            # read at once: there is no device to wait for (tolist reads the number without
            # an operation of its own, where item makes one)
            value = loss.tolist()
            if isinstance(value, float) and math.isfinite(value):
                return NOTHING_SEEN  # one process, a finite loss: nothing to agree on
        kept = Kept(step, loss.detach(), self._kept)
        if self.policy == "error" and not ends_step:
            return Look(kept=kept)
        if local_only:
            first = kept.first_bad_step()
            if first > 0:
                raise NonFiniteLossError(_message(str(collective.rank), first, self.policy))
            return NOTHING_SEEN
        # one process reads its agreement on the host: the losses themselves
        bad = kept.losses() if deferred and collective.world_size == 1 else kept.flag()
        return Look(bad=bad, kept=kept)

    def pending(self, device: torch.device) -> Look:
        """What this process kept since the last agreement, as the look of an agreement
        made now."""
        kept = self._kept
        if kept is None:
            return Look(bad=torch.zeros((), dtype=torch.float64, device=device))
        return Look(bad=kept.flag(), kept=kept)

    def settle(self, look: Look, collective: Collective, bad: bool) -> bool:
        """After the processes agreed that ``bad`` (some process saw a non-finite loss):
        whether the backward runs; raises under the ``error`` policy."""
        self.sent(look)
        return self.judge(look, collective, bad)

    def sent(self, look: Look) -> None:
        """``look`` went into the step's agreement (the next micro-batch starts afresh), or
        is kept for the one that agrees."""
        self._kept = look.kept if look.bad is None else None

    def judge(self, look: Look, collective: Collective, bad: bool) -> bool:
        """The policy's answer once the processes agreed that ``bad``: True when the
        micro-batch's gradients count; raises under the ``error`` policy."""
        if look.bad is None or not bad:
            return True
        at = look.kept.first_bad_step() if look.kept is not None else 0
        first = torch.tensor([float(at)], dtype=torch.float64, device=look.bad.device)
        steps = [int(part) for part in collective.all_gather(first)]
        # the first: later ones on other ranks may only be its consequence (the gradients
        # all-reduced between two agreements carried the NaN to every rank's weights)
        step = min(at for at in steps if at > 0)
        ranks = ", ".join(str(rank) for rank, at in enumerate(steps) if at == step)
        if self.policy == "error":
            raise NonFiniteLossError(_message(ranks, step, self.policy))
        collective.note(f"paratrain: note: {_message(ranks, step, self.policy)}")
        return False


def _message(ranks: str, step: int, policy: str) -> str:
    who = f"rank{'s' if ',' in ranks else ''} {ranks}"
    if policy == "skip":
        return f"the loss is NaN or infinite on {who} at step {step}; every rank skipped it"
    return (
        f"the loss is NaN or infinite on {who} at step {step}; every rank stopped there "
        "(--skip-nonfinite skips such steps instead)"
    )
