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


@dataclass(frozen=True)
class Look:
    """One micro-batch's loss seen by this process alone, before the processes agree."""

    step: int
    ends_step: bool
    #: this process's non-finite flag, to agree on now (None: nothing to agree on)
    bad: torch.Tensor | None = None
    #: the step of this process's first non-finite loss since the last agreement (0: none;
    #: float64, on the device), kept for the micro-batch that agrees
    keep: torch.Tensor | None = None


class NonFiniteCheck:
    """Whether a loss was finite, judged on every process alike (the policy's answer); the
    step pipeline (:mod:`paratrain.runtime.step`) runs it, the step's agreement carries it."""

    def __init__(self, policy: str = "error") -> None:
        """``policy``: the runtime configuration's ``nonfinite`` option (which reads
        ``PARATRAIN_NONFINITE`` when it is built)."""
        self.policy = policy
        if self.policy not in POLICIES:
            raise UserError(f"non-finite policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        self._pending: torch.Tensor | None = None  # earlier micro-batches of this step

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
        ``deferred``: the verdict is read later, so the loss is not read here either."""
        if self.policy == "off":
            return Look(step, ends_step)
        if (
            not deferred
            and collective.world_size == 1
            and self._pending is None
            and loss.is_cpu  # reading it costs no device sync (no torch.device made)
            and math.isfinite(loss.item())
        ):
            return Look(step, ends_step)  # one process, a finite loss: no tensor to make
        # the first non-finite loss's step, kept on the device (no sync): the agreement may
        # come steps later (the quiet path's pace), and the message names this one
        now = torch.where(~torch.isfinite(loss.detach().double()), float(step), 0.0)
        first = now if self._pending is None else torch.where(self._pending > 0, self._pending, now)
        if self.policy == "error" and not ends_step:
            return Look(step, ends_step, keep=first)
        if local_only:
            if bool(first > 0):
                raise NonFiniteLossError(_message(str(collective.rank), int(first), self.policy))
            return Look(step, ends_step)
        return Look(step, ends_step, bad=first > 0, keep=first)

    def pending(self, step: int, device: torch.device) -> Look:
        """What this process kept since the last agreement (its first non-finite loss's
        step, or none), as the look of an agreement made now."""
        first = self._pending
        if first is None:
            first = torch.zeros((), dtype=torch.float64, device=device)
        return Look(step, True, bad=first > 0, keep=first)

    def settle(self, look: Look, collective: Collective, bad: bool) -> bool:
        """After the processes agreed that ``bad`` (some process saw a non-finite loss):
        whether the backward runs; raises under the ``error`` policy."""
        self.sent(look)
        return self.judge(look, collective, bad)

    def sent(self, look: Look) -> None:
        """``look`` went into the step's agreement (the next micro-batch starts afresh), or
        is kept for the one that agrees."""
        self._pending = look.keep if look.bad is None else None

    def judge(self, look: Look, collective: Collective, bad: bool) -> bool:
        """The policy's answer once the processes agreed that ``bad``: True when the
        micro-batch's gradients count; raises under the ``error`` policy."""
        if look.bad is None or not bad:
            return True
        first = look.keep if look.keep is not None else look.bad.double() * look.step
        steps = [int(part) for part in collective.all_gather(first.reshape(1))]
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
