"""An optimizer that steps through the precision policy and honours gradient accumulation.

It is only used when needed (fp16 with a GradScaler, accumulation, the non-finite ``skip``
policy): otherwise the user's optimizer is returned untouched and costs nothing. It stays an
instance of the user's optimizer class and shares the original's attributes
(``param_groups``, ``state``), so LR schedulers, ``isinstance`` checks and
``load_state_dict`` keep working on either object.

It counts the ``step()`` calls that applied gradients (:class:`OptimizerSteps`): a scheduler
handed to ``rt.setup`` advances only after those (:mod:`paratrain.runtime.schedulers`). A
learning rate that changes after a call that applied nothing (a scheduler stepped on every
micro-batch, not handed to ``rt.setup``) is warned about once.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from paratrain.devices.precision import Precision
from paratrain.runtime.step_state import OptimizerSteps, StepState

_SCALER_ATTRIBUTES = frozenset({"grad_scale", "found_inf"})


class _BaseStep:
    """The original optimizer's own ``step``, immune to instance patches (LR schedulers
    patch ``step`` on the instance; calling through it would recurse into ours)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True for fused optimizers: GradScaler then lets their kernel unscale."""
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def __getattr__(self, name: str) -> Any:
        if name in _SCALER_ATTRIBUTES:
            return getattr(self.optimizer, name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        # GradScaler hands a fused optimizer the scale and the inf flag as attributes
        # (grad_scale, found_inf) that its step reads: they must land on the optimizer.
        if name in _SCALER_ATTRIBUTES:
            setattr(self.optimizer, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in _SCALER_ATTRIBUTES:
            delattr(self.optimizer, name)
        else:
            super().__delattr__(name)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.optimizer).step(self.optimizer, *args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        type(self.optimizer).zero_grad(self.optimizer, set_to_none=set_to_none)


#: what the warning about a scheduler stepped while nothing was applied says
UNHANDED_SCHEDULER = (
    "the learning rate changed after an optimizer.step() that applied no gradients "
    "(accumulating micro-batches, or a skipped step): a scheduler stepped after every "
    "optimizer.step() runs ahead of the steps taken (twice as fast with accumulate=2). Hand "
    "it to rt.setup, model, optimizer, scheduler = rt.setup(model, optimizer, scheduler), "
    "and it advances only when the gradients are applied"
)


class RuntimeOptimizer:
    _paratrain_precision: Precision
    _paratrain_state: StepState
    _paratrain_base: _BaseStep
    _paratrain_stepped: bool
    _paratrain_steps: OptimizerSteps
    _paratrain_watch: _RateWatch

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        state: StepState,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.__dict__ = optimizer.__dict__
        self.__class__ = type(
            f"Runtime{type(optimizer).__name__}", (RuntimeOptimizer, type(optimizer)), {}
        )
        self._paratrain_precision = precision
        self._paratrain_state = state
        self._paratrain_base = _BaseStep(optimizer)
        self._paratrain_stepped = False
        self._paratrain_steps = OptimizerSteps()
        self._paratrain_watch = _RateWatch(warn)
        _route_scheduler_patch(self)

    def step(self, closure: Any = None) -> Any:
        state, watch = self._paratrain_state, self._paratrain_watch
        groups = self._paratrain_base.param_groups
        watch.check(groups)
        if not state.sync_gradients:  # still accumulating micro-batches
            self._paratrain_steps.called(applied=False)
            watch.remember(groups)
            return None
        kwargs = {} if closure is None else {"closure": closure}
        scale = self._paratrain_precision.scaler
        before = None if scale is None else _scale_tensor(scale)
        result = self._paratrain_precision.optimizer_step(self._paratrain_base, **kwargs)
        state.applied()
        self._paratrain_stepped = True
        overflowed = None
        if before is not None and scale is not None:
            after = _scale_tensor(scale)  # lowered by the update: the step was skipped
            overflowed = None if after is None else after < before
        applied = not state.group_skipped
        self._paratrain_steps.called(applied, overflowed)
        if applied:
            watch.forget()
        else:
            watch.remember(groups)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Keep accumulated gradients until they have been applied, whichever order the
        # loop calls zero_grad and step in.
        if self._paratrain_state.accumulate > 1 and not self._paratrain_stepped:
            return
        self._paratrain_base.zero_grad(set_to_none=set_to_none)
        self._paratrain_stepped = False

    def unscale_gradients(self) -> None:
        """Before clipping under fp16, bring the gradients back to their true scale."""
        self._paratrain_precision.unscale(self._paratrain_base)


class _RateWatch:
    """The learning rates after a ``step()`` that applied nothing: one that differs at the
    next call was changed meanwhile by something not handed to ``rt.setup``."""

    def __init__(self, warn: Callable[[str], None] | None) -> None:
        self.warn = warn
        self.rates: list[Any] | None = None
        self.warned = False

    def remember(self, groups: list[dict[str, Any]]) -> None:
        if self.warn is None or self.warned:
            return
        rates = [group.get("lr") for group in groups]
        # a tensor rate (capturable optimizers) is not read: that would wait for the device
        self.rates = rates if all(isinstance(r, (int, float)) for r in rates) else None

    def forget(self) -> None:
        self.rates = None

    def check(self, groups: list[dict[str, Any]]) -> None:
        if self.rates is None or self.warn is None:
            return
        if [group.get("lr") for group in groups] != self.rates:
            self.warned = True
            self.rates = None
            self.warn(UNHANDED_SCHEDULER)


def _scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The GradScaler's scale as a tensor (no device sync), a copy: its update changes it in
    place."""
    scale = scaler._get_scale_async()
    return None if scale is None else scale.clone()


def _route_scheduler_patch(optimizer: RuntimeOptimizer) -> None:
    """An LR scheduler built before ``rt.setup`` patched ``step`` on the optimizer instance
    (to check the order of calls), in the ``__dict__`` this wrapper shares: that patch would
    call the plain class's step and bypass accumulation. It is replaced by one that marks
    the call the same way and steps through the wrapper."""
    patched = optimizer.__dict__.get("step")
    if patched is None or not getattr(patched, "_wrapped_by_lr_sched", False):
        return
    ref = weakref.ref(optimizer)

    def step(*args: Any, **kwargs: Any) -> Any:
        wrapped = ref()
        assert wrapped is not None  # called through it
        wrapped._opt_called = True  # type: ignore[attr-defined]
        return RuntimeOptimizer.step(wrapped, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.__dict__["step"] = step


def warn_once_on_main(is_main: bool) -> Callable[[str], None]:
    """A UserWarning said once, by the main process only."""
    said = False

    def warn(message: str) -> None:
        nonlocal said
        if is_main and not said:
            said = True
            warnings.warn(message, UserWarning, stacklevel=4)

    return warn


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move state an optimizer already holds (momentum buffers...) next to its parameters."""
    for state in optimizer.state.values():
        for key, value in state.items():
            # Adam's scalar "step" stays on the CPU, as PyTorch keeps it.
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device)
