"""Learning-rate schedulers handed to ``rt.setup``: ``scheduler.step()`` advances only
after an ``optimizer.step()`` that applied gradients.

Most loops step the scheduler after every ``optimizer.step()`` call. Under
``accumulate=N`` that call applies the gradients once every N micro-batches, so a plain
scheduler would run N times too fast; a step skipped for a non-finite loss (the ``skip``
policy) or by a GradScaler overflow applies nothing either. The scheduler ``rt.setup``
returns steps only when the optimizer applied gradients since its previous ``step()``
(the optimizer wrapper counts them: :class:`~paratrain.runtime.step_state.OptimizerSteps`),
or when the optimizer was not stepped at all since then (a loop that steps the scheduler
first, or once an epoch, keeps its schedule).

The returned scheduler is an instance of the user's class and shares its attributes: its
``state_dict()`` and ``load_state_dict()`` are the user's, so checkpoints are the same files
as without paratrain. Where no optimizer step can go unapplied (no accumulation, no
GradScaler, no ``skip`` policy) the scheduler is returned untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.runtime.step_state import OptimizerSteps
from paratrain.utils.errors import UserError


def is_scheduler(obj: Any) -> bool:
    """An LR scheduler (torch's, or any object with ``step()`` and ``state_dict()`` that is
    not a function, as a loss is)."""
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return True
    return (
        not callable(obj)
        and callable(getattr(obj, "step", None))
        and callable(getattr(obj, "state_dict", None))
    )


class _Gate:
    """Whether a scheduler's ``step()`` advances: the optimizer applied gradients since its
    previous call, or was not stepped at all."""

    def __init__(self, steps: OptimizerSteps) -> None:
        self.steps = steps
        self.calls = steps.calls
        self.applied = steps.applied

    def opens(self) -> bool:
        calls, applied = self.steps.calls, self.steps.applied
        opens = applied > self.applied or calls == self.calls
        self.calls, self.applied = calls, applied
        return opens


class GatedScheduler:
    """Mixed into a subclass of the user's scheduler class (see :func:`gate_scheduler`)."""

    __slots__ = ()
    _paratrain_base: type
    _paratrain_gate: _Gate

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._paratrain_gate.opens():
            return None  # the optimizer applied nothing since the previous step
        return super().step(*args, **kwargs)  # type: ignore[misc]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickled and copied as the user's own class (this one is made at run time)
        return _rebuilt, (self._paratrain_base, self.__dict__)


def _rebuilt(cls: type, state: dict[str, Any]) -> Any:
    """A pickled or copied scheduler, of the user's class."""
    plain: Any = object.__new__(cls)
    plain.__dict__.update(state)
    return plain


class _SchedulerProxy:
    """A scheduler whose class cannot be subclassed with a shared ``__dict__``: every
    attribute is the scheduler's, ``step()`` gated."""

    def __init__(self, scheduler: Any, gate: _Gate) -> None:
        object.__setattr__(self, "_paratrain_scheduler", scheduler)
        object.__setattr__(self, "_paratrain_gate", gate)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance() sees the scheduler's class
        return type(self._paratrain_scheduler)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._paratrain_gate.opens():
            return None
        return self._paratrain_scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._paratrain_scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._paratrain_scheduler, name, value)


def gate_scheduler(scheduler: Any, optimizer: Any, steps: OptimizerSteps | None) -> Any:
    """``scheduler`` stepping only when ``optimizer`` (the one ``rt.setup`` returns)
    applied gradients, which ``steps`` counts; untouched where every step applies (None)."""
    own = getattr(scheduler, "optimizer", None)
    if isinstance(own, torch.optim.Optimizer) and own.__dict__ is not optimizer.__dict__:
        raise UserError(
            f"rt.setup: the {type(scheduler).__name__} schedules another optimizer than the "
            "one handed to rt.setup; build it from that optimizer"
        )
    if steps is None:
        return scheduler  # a plain optimizer: every step applies
    gate = _Gate(steps)
    base = type(scheduler)
    if isinstance(scheduler, GatedScheduler):  # handed again: one gate, the newest
        base = scheduler._paratrain_base
    try:
        gated_class: Any = type(
            f"Gated{base.__name__}",
            (GatedScheduler, base),
            {"__slots__": ("_paratrain_gate",)},
        )
        gated: Any = object.__new__(gated_class)
        gated.__dict__ = scheduler.__dict__  # the same state: state_dict() is the user's
    except (TypeError, AttributeError):  # no __dict__, a final class, a layout conflict
        return _SchedulerProxy(scheduler, gate)
    gated_class._paratrain_base = base
    gated._paratrain_gate = gate
    return gated
