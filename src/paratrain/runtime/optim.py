"""An optimizer that steps through the precision policy and honours gradient accumulation.

It is only used when needed (fp16 with a GradScaler, or accumulation): otherwise the user's
optimizer is returned untouched and costs nothing. It stays an instance of the user's
optimizer class and shares the original's attributes (``param_groups``, ``state``), so LR
schedulers, ``isinstance`` checks and ``load_state_dict`` keep working on either object.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.devices.precision import Precision
from paratrain.runtime.step_state import StepState

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


class RuntimeOptimizer:
    _paratrain_precision: Precision
    _paratrain_state: StepState
    _paratrain_base: _BaseStep
    _paratrain_stepped: bool

    def __init__(
        self, optimizer: torch.optim.Optimizer, precision: Precision, state: StepState
    ) -> None:
        self.__dict__ = optimizer.__dict__
        self.__class__ = type(
            f"Runtime{type(optimizer).__name__}", (RuntimeOptimizer, type(optimizer)), {}
        )
        self._paratrain_precision = precision
        self._paratrain_state = state
        self._paratrain_base = _BaseStep(optimizer)
        self._paratrain_stepped = False

    def step(self, closure: Any = None) -> Any:
        state = self._paratrain_state
        if not state.sync_gradients:
            return None  # still accumulating micro-batches
        kwargs = {} if closure is None else {"closure": closure}
        result = self._paratrain_precision.optimizer_step(self._paratrain_base, **kwargs)
        state.applied()
        self._paratrain_stepped = True
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


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move state an optimizer already holds (momentum buffers...) next to its parameters."""
    for state in optimizer.state.values():
        for key, value in state.items():
            # Adam's scalar "step" stays on the CPU, as PyTorch keeps it.
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device)
