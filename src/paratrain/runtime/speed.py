"""The runtime's speed options: ``torch.compile``, channels last, fused optimizer steps.

None of them changes what is trained, only how fast (results move by floating-point
rounding). :class:`Speed` applies them at the points of ``rt.setup`` where they belong:

1. the bare model on its device: channels-last parameters (:mod:`paratrain.runtime.memory_format`);
2. the model wrapped by the strategy: ``torch.compile`` of the wrapper, as torch recommends
   for DDP (:mod:`paratrain.runtime.compiling`), then 4-D inputs made channels last before the
   compiled forward (the runtime wraps the result in its autocast afterwards: autocast
   enters outside the compiled graph, which dynamo traces under it);
3. the optimizer: fused step (:mod:`paratrain.runtime.fused`), state kept in the parameters'
   layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paratrain.runtime import memory_format
from paratrain.runtime.compile_check import CompileCheck
from paratrain.runtime.compiling import (
    STRICT,
    check_compile,
    compile_counts,
    compile_model,
    normalize_compile,
    resolve_mode,
)
from paratrain.runtime.fused import apply_fused
from paratrain.strategies import Strategy


@dataclass(frozen=True)
class SpeedOptions:
    """``compile``: None (off), ``"auto"`` or a torch.compile mode; ``channels_last`` and
    ``fused_optimizer``: None (automatic), True or False."""

    compile: str | None = field(
        default=None,
        metadata={
            "help": "True, or a torch.compile mode (paratrain.runtime.compiling)",
            "flag": "--compile",
        },
    )
    channels_last: bool | None = field(
        default=None,
        metadata={
            "help": "None: for a model with Conv2d on CUDA (paratrain.runtime.speed)",
            "flag": "--channels-last",
        },
    )
    fused_optimizer: bool | None = field(
        default=None,
        metadata={"help": "None: SGD/Adam/AdamW on CUDA (paratrain.runtime.speed)", "flag": None},
    )

    @classmethod
    def of(
        cls,
        compile: bool | str | None = None,
        channels_last: bool | None = None,
        fused_optimizer: bool | None = None,
    ) -> SpeedOptions:
        """Validated options from the runtime's arguments (``compile=True`` -> ``"auto"``)."""
        return cls(normalize_compile(compile), channels_last, fused_optimizer)


def check_speed(strategy: Strategy, options: SpeedOptions) -> None:
    """``UserError`` for options ``strategy`` cannot honour, before any process starts."""
    check_compile(
        strategy.compile_refused(), strategy.compile_mode, strategy.root_device, options.compile
    )


class Speed:
    """Applies :class:`SpeedOptions` for one strategy and remembers what it applied."""

    def __init__(self, options: SpeedOptions, strategy: Strategy) -> None:
        check_speed(strategy, options)
        self.options = options
        self.strategy = strategy
        self.mode = (
            None
            if options.compile is None
            else resolve_mode(options.compile, strategy.compile_mode)
        )
        self.channels_last = False
        self.fused = "no optimizer"
        #: the compiled model's first-step gradients against eager (compile on only)
        self.check: CompileCheck | None = None

    def prepare_model(self, model: nn.Module) -> None:
        """Before the strategy wraps ``model`` (already on its device)."""
        self.channels_last = memory_format.wants_channels_last(
            self.options.channels_last, model, self.strategy.root_device
        )
        if self.channels_last:
            memory_format.convert_model(model)

    def wrap_model(
        self,
        wrapped: nn.Module,
        precision: str = "32",
        autocast: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> nn.Module:
        """After the strategy wrapped the model: compile it (checked against eager on the
        first step, under ``precision`` and its ``autocast``), convert inputs."""
        if self.mode is not None:
            wrapped = compile_model(wrapped, self.mode)
            self.check = CompileCheck(
                wrapped,
                strict=self.options.compile == STRICT,
                precision=precision,
                collective=self.strategy.collective,
                autocast=autocast or contextlib.nullcontext,
                compile_time=compile_counts,
            )
            if self.strategy.compile_check_refused is not None:
                self.check.skip(self.strategy.compile_check_refused)
        if self.channels_last:
            wrapped = memory_format.convert_inputs(wrapped)
        return wrapped

    def after_backward(self) -> None:
        """After each ``rt.backward``: the compile check, on the first step."""
        if self.check is not None:
            self.check.after_backward()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Once the optimizer's parameters (and any state) are on the device."""
        self.fused = apply_fused(optimizer, self.options.fused_optimizer)
        if self.channels_last:
            memory_format.match_parameter_layout(optimizer)

    def describe(self) -> dict[str, Any]:
        return {
            "compile": self.mode,
            "channels_last": self.channels_last,
            "fused_optimizer": self.fused,
            "compile_check": None if self.check is None else self.check.describe(),
        }
