"""An optimizer that steps through the precision policy and honours gradient accumulation.

It is only used when needed (fp16 with a GradScaler, or accumulation): otherwise the user's
optimizer is returned untouched and costs nothing. It stays an instance of the user's
optimizer class and shares the original's attributes (``param_groups``, ``state``), so LR
schedulers, ``isinstance`` checks and ``load_state_dict`` keep working on either object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paratrain.devices.precision import Precision


@dataclass
class Accumulation:
    """Where gradient accumulation stands: the runtime advances it in ``backward``, the
    optimizer reads it in ``step``, and sharded loaders set the per-batch fields."""

    #: micro-batches per optimizer step
    steps: int = 1
    #: micro-batches whose gradients are summed since the last optimizer step
    micro_steps: int = 0
    #: whether the next ``optimizer.step()`` applies the gradients
    sync_gradients: bool = True
    #: this process's loss weight for the current batch (uneven last batches across
    #: processes), set by sharded loaders
    loss_weight: float = 1.0
    #: the current batch is the epoch's last: an unfinished group of micro-batches is applied
    at_last_batch: bool = False

    def micro_batch_done(self) -> None:
        if self.steps > 1:
            self.micro_steps += 1
            self.sync_gradients = self.micro_steps >= self.steps or self.at_last_batch

    def applied(self) -> None:
        self.micro_steps = 0
        self.sync_gradients = self.steps == 1

    def next_is_last(self) -> bool:
        """Whether the coming micro-batch ends its group (its gradients get synchronized)."""
        return self.micro_steps + 1 >= self.steps or self.at_last_batch


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
    _paratrain_accumulation: Accumulation
    _paratrain_base: _BaseStep
    _paratrain_stepped: bool

    def __init__(
        self, optimizer: torch.optim.Optimizer, precision: Precision, accumulation: Accumulation
    ) -> None:
        self.__dict__ = optimizer.__dict__
        self.__class__ = type(
            f"Runtime{type(optimizer).__name__}", (RuntimeOptimizer, type(optimizer)), {}
        )
        self._paratrain_precision = precision
        self._paratrain_accumulation = accumulation
        self._paratrain_base = _BaseStep(optimizer)
        self._paratrain_stepped = False

    def step(self, closure: Any = None) -> Any:
        accumulation = self._paratrain_accumulation
        if not accumulation.sync_gradients:
            return None  # still accumulating micro-batches
        kwargs = {} if closure is None else {"closure": closure}
        result = self._paratrain_precision.optimizer_step(self._paratrain_base, **kwargs)
        accumulation.applied()
        self._paratrain_stepped = True
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Keep accumulated gradients until they have been applied, whichever order the
        # loop calls zero_grad and step in.
        if self._paratrain_accumulation.steps > 1 and not self._paratrain_stepped:
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
