"""Non-finite losses: every rank stops (or skips) at the same step, and one message names the
rank and the step.

``rt.backward(loss)`` asks :meth:`NonFiniteCheck.admit` before the backward pass of every
micro-batch. Once per optimizer step (before the backward of the micro-batch that ends it,
so before the gradients are all-reduced) the ranks agree with one all-reduce of three
float64 numbers: a marker, how many ranks saw a non-finite loss, and the step. That is the
cost of the check: one small collective per optimizer step (and, on a GPU, reading one
number back). Only when a rank saw one does a second collective find which ranks.

Policies (``PARATRAIN_NONFINITE``, or ``--skip-nonfinite``):

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
-1 (:meth:`NonFiniteCheck.agree`). A rank that ran out of batches and goes on to such a
collective meets a rank still training at its step check; both see the mismatch and fail
with one message, instead of pairing unrelated collectives (which gloo may turn into an
abort, or into a hang).
"""

from __future__ import annotations

import math
import os

import torch

from paratrain.distributed.collective import Collective
from paratrain.utils.errors import LaunchError, NonFiniteLossError, UserError

POLICY_VARIABLE = "PARATRAIN_NONFINITE"
POLICIES = ("error", "skip", "off")
_MARKER = 7919.0  # a prime: a sum of other numbers is unlikely to hit a multiple of it


def policy_from_env() -> str:
    policy = os.environ.get(POLICY_VARIABLE) or "error"
    if policy not in POLICIES:
        raise UserError(f"{POLICY_VARIABLE}={policy!r}: use one of {', '.join(POLICIES)}")
    return policy


class NonFiniteCheck:
    """Counts optimizer steps and agrees across ranks whether a loss was finite."""

    def __init__(self, policy: str | None = None) -> None:
        self.policy = policy or policy_from_env()
        if self.policy not in POLICIES:
            raise UserError(f"non-finite policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        #: optimizer steps begun before the current one (a resumed loop sets its count)
        self.step = 0
        #: whether the last micro-batch's backward was skipped (policy ``skip``)
        self.skipped = False
        #: inside ``rt.join``: a rank that ran out of data takes no part in this collective,
        #: so each rank checks only its own loss and fails alone
        self.local_only = False
        self._pending: torch.Tensor | None = None  # earlier micro-batches of this step

    def admit(self, loss: torch.Tensor, collective: Collective, ends_step: bool) -> bool:
        """Whether this micro-batch's backward runs; raises under the ``error`` policy."""
        step = self.step + 1
        if ends_step:
            self.step = step
        self.skipped = False
        if self.policy == "off":
            return True
        if (
            collective.world_size == 1
            and self._pending is None
            and loss.is_cpu  # reading it costs no device sync (no torch.device made)
            and math.isfinite(loss.item())
        ):
            return True  # one process, a finite loss: nothing to agree on, no tensor to make
        bad = ~torch.isfinite(loss.detach())
        if self.policy == "error" and not ends_step:
            self._pending = bad if self._pending is None else self._pending | bad
            return True
        if self._pending is not None:
            bad, self._pending = bad | self._pending, None
        if self.local_only:
            if bool(bad):
                raise NonFiniteLossError(_message(str(collective.rank), step, self.policy))
            return True
        known = loss.new_tensor([_MARKER, 0.0, float(step)], dtype=torch.float64)
        known[1] = bad.to(torch.float64)  # stays on the device: no sync before the collective
        verdict = self._exchange(collective, known, f"at training step {step}")
        if verdict[1] == 0:
            return True
        flags = collective.all_gather(bad.reshape(1).to(torch.uint8))
        ranks = ", ".join(str(rank) for rank, flag in enumerate(flags) if bool(flag))
        if self.policy == "error":
            raise NonFiniteLossError(_message(ranks, step, self.policy))
        collective.note(f"paratrain: note: {_message(ranks, step, self.policy)}")
        self.skipped = True
        return False

    def agree(self, collective: Collective, what: str) -> None:
        """Before a collective of the user's: check that every rank is at one too."""
        if collective.world_size > 1 and not self.local_only:
            known = torch.tensor([_MARKER, 0.0, -1.0], dtype=torch.float64)
            self._exchange(collective, known, f"in rt.{what} after {self.step} training steps")

    def _exchange(self, collective: Collective, known: torch.Tensor, here: str) -> list[float]:
        verdict: list[float] = collective.all_reduce(known, "sum").tolist()
        world = collective.world_size
        if verdict[0] != _MARKER * world or verdict[2] != known[2].item() * world:
            raise LaunchError(
                f"rank {collective.rank} is {here}, but not every rank is: the ranks ran "
                "different numbers of batches. Give every rank the same number of batches "
                "(rt.setup_loader does), or wrap the loop in `with rt.join(model):`"
            )
        return verdict


def _message(ranks: str, step: int, policy: str) -> str:
    who = f"rank{'s' if ',' in ranks else ''} {ranks}"
    if policy == "skip":
        return f"the loss is NaN or infinite on {who} at step {step}; every rank skipped it"
    return (
        f"the loss is NaN or infinite on {who} at step {step}; every rank stopped there "
        "(--skip-nonfinite skips such steps instead)"
    )
