"""The runtime's checkpoints (``rt.save``, ``rt.load``, ``rt.save_weights``): the
collective operations around :mod:`paratrain.checkpoints.state`, named for the
collective-order check, each first checking that every rank is in the same call
(:mod:`paratrain.runtime.call_check`: a rank guard kept around ``rt.save`` stops the run
there, with one message)."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from paratrain.checkpoints.state import GroupPosition, load_state, save_model_weights, save_state
from paratrain.runtime.call_check import Call, check_call
from paratrain.runtime.parts import RuntimeParts


class RuntimeCheckpoints:
    """Saving and loading through the runtime's processes and devices."""

    def __init__(self, rt: RuntimeParts) -> None:
        self.rt = rt

    def save(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        strategy, step = self.rt.strategy, self.rt.state
        # inside an accumulation group (``Runtime(accumulate=N)``'s, or one a loop makes
        # by hand: backwards no optimizer.step() applied yet): its gradients and position
        # too (only then)
        group = None
        if step.micro_steps or step.unapplied:
            done = step.micro_steps or step.unapplied
            group = GroupPosition(done, step.accumulate, step.sync_gradients)
        with strategy.collective.operation("rt.save"):
            self._agree("rt.save")
            save_state(strategy.collective, strategy.devices, path, state, group)

    def load(
        self, path: str | os.PathLike[str], into: dict[str, Any] | None, rng: bool
    ) -> dict[str, Any]:
        strategy = self.rt.strategy
        with strategy.collective.operation("rt.load"):
            self._agree("rt.load")
            return load_state(strategy.collective, strategy.devices, path, into, rng, self.rt.state)

    def save_weights(self, model: nn.Module, path: str | os.PathLike[str]) -> None:
        collective = self.rt.strategy.collective
        with collective.operation("rt.save_weights"):
            self._agree("rt.save_weights")
            save_model_weights(collective, model, path)

    def _agree(self, name: str) -> None:
        check_call(self.rt, Call.of(name), f"in {name} after {self.rt.state.step} training steps")
