"""An optimizer that steps through the precision policy and honours gradient accumulation.

It is only used when needed (fp16 with a GradScaler, or accumulation): otherwise the user's
optimizer is returned untouched and costs nothing. It stays an instance of the user's
optimizer class and shares the original's attributes (``param_groups``, ``state``), so LR
schedulers, ``isinstance`` checks and ``load_state_dict`` keep working on either object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from paratrain.runtime import Runtime


class _BaseStep:
    """The original optimizer's own ``step``, immune to instance patches (LR schedulers
    patch ``step`` on the instance; calling through it would recurse into ours)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._step_supports_amp_scaling = getattr(optimizer, "_step_supports_amp_scaling", False)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.optimizer).step(self.optimizer, *args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        type(self.optimizer).zero_grad(self.optimizer, set_to_none=set_to_none)


class RuntimeOptimizer:
    _paratrain_rt: Runtime
    _paratrain_base: _BaseStep
    _paratrain_stepped: bool

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: Runtime) -> None:
        self.__dict__ = optimizer.__dict__
        self.__class__ = type(
            f"Runtime{type(optimizer).__name__}", (RuntimeOptimizer, type(optimizer)), {}
        )
        self._paratrain_rt = runtime
        self._paratrain_base = _BaseStep(optimizer)
        self._paratrain_stepped = False

    def step(self, closure: Any = None) -> Any:
        runtime = self._paratrain_rt
        if not runtime.sync_gradients:
            return None  # still accumulating micro-batches
        kwargs = {} if closure is None else {"closure": closure}
        result = runtime.precision.optimizer_step(self._paratrain_base, **kwargs)
        runtime._gradients_applied()
        self._paratrain_stepped = True
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Keep accumulated gradients until they have been applied, whichever order the
        # loop calls zero_grad and step in.
        if self._paratrain_rt.accumulate_steps > 1 and not self._paratrain_stepped:
            return
        self._paratrain_base.zero_grad(set_to_none=set_to_none)
        self._paratrain_stepped = False

    def unscale_gradients(self) -> None:
        """Before clipping under fp16, bring the gradients back to their true scale."""
        self._paratrain_rt.precision.unscale(self._paratrain_base)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move state an optimizer already holds (momentum buffers...) next to its parameters."""
    for state in optimizer.state.values():
        for key, value in state.items():
            # Adam's scalar "step" stays on the CPU, as PyTorch keeps it.
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device)
