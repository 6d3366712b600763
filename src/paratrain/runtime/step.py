"""The runtime's step: ``rt.backward`` and ``rt.forward_backward``, through the precision
policy, scaled for accumulation, with the non-finite check, the fault injection points,
the pieces of ``--oom auto`` and the pipeline's joint forward and backward."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.launching import faults, heartbeat
from paratrain.runtime.determinism import naming_nondeterministic
from paratrain.runtime.oom_step import PieceStep
from paratrain.runtime.parts import RuntimeView
from paratrain.utils.errors import PlacementError, UserError


class TrainingStep:
    """One micro-batch's forward and backward, as every strategy runs it."""

    def __init__(self, rt: RuntimeView) -> None:
        self.rt = rt

    def forward_backward(
        self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, target: Any
    ) -> torch.Tensor:
        rt = self.rt
        if rt.micro_batches.active:
            return PieceStep(
                rt.strategy,
                rt.accumulation,
                rt.nonfinite,
                rt.micro_batches,
                self._precision_backward,
            ).run(model, loss_fn, inputs, target)
        if not rt.strategy.trains_in_pipeline:
            loss = loss_fn(model(inputs), target)
            self.backward(loss)
            return loss
        with rt.strategy.collective.operation("rt.forward_backward"):
            return self._pipeline_step(model, loss_fn, inputs, target)

    def _pipeline_step(
        self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, target: Any
    ) -> torch.Tensor:
        rt = self.rt
        accumulation, collective = rt.accumulation, rt.strategy.collective
        ends_step = accumulation.next_is_last()
        scale = accumulation.loss_weight / accumulation.steps
        step = rt.nonfinite.step + 1
        with heartbeat.waiting():
            part = rt.strategy.train_step(model, inputs, target, loss_fn, scale)
            # the last stage has the loss; another judges its own part, nothing but a fault
            mine = part if part is not None else torch.zeros((), device=rt.strategy.root_device)
            mine = faults.at_step(collective.rank, step, mine)
            look = rt.nonfinite.look(mine, collective, ends_step)
            # the step's one small all-reduce brings the loss to every process as well
            agreed = rt.nonfinite.agreement.exchange(
                collective,
                step,
                f"at training step {step}",
                bad=look.bad if look.bad is not None else ~torch.isfinite(mine),
                value=None if part is None else mine,
            )
            value = math.nan if agreed.bad else agreed.value
            loss = torch.tensor(value, dtype=torch.float32, device=mine.device)
            # the gradients are there already: a skipped micro-batch's are dropped
            if not rt.nonfinite.settle(look, collective, agreed.bad):
                model.zero_grad(set_to_none=True)
        accumulation.micro_batch_done()
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        strategy = self.rt.strategy
        if strategy.trains_in_pipeline:
            raise UserError(
                f"--strategy {strategy.name} runs forward and backward together: use "
                "loss = rt.forward_backward(model, loss_fn, x, y) instead of rt.backward(loss)"
            )
        if loss.dim() != 0:
            raise PlacementError("rt.backward expects a scalar loss tensor")
        with strategy.collective.operation("rt.backward"):  # the gradient all-reduce
            self._backward(loss)

    def _backward(self, loss: torch.Tensor) -> None:
        rt = self.rt
        accumulation = rt.accumulation
        ends_step = accumulation.next_is_last()
        loss = faults.at_step(rt.strategy.collective.rank, rt.nonfinite.step + 1, loss)
        with heartbeat.waiting():  # the step's collectives: waits on the other ranks
            admitted = rt.nonfinite.admit(loss, rt.strategy.collective, ends_step)
            if admitted:
                scale = accumulation.loss_weight / accumulation.steps
                self._precision_backward(loss * scale if scale != 1.0 else loss)
                rt.speed.after_backward()  # --compile: the first step checked against eager
        accumulation.micro_batch_done()  # a skipped micro-batch too: on every rank alike

    def _precision_backward(self, loss: torch.Tensor) -> None:
        backward = self.rt.precision.backward
        if self.rt.config.deterministic:
            backward = naming_nondeterministic(backward)
        backward(loss)
