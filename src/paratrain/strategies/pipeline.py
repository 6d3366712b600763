"""Pipeline parallelism: the model's layers split into stages, one process per device, each
holding only its stage's parameters, gradients and optimizer state.

Every process reads the same global batch; the first stage feeds the inputs, the last
computes the loss, and torch.distributed.pipelining's schedule (1F1B by default, or GPipe)
runs the batch's micro-batches through the stages. Where the model is cut:
:mod:`.pipeline_plan`. Process setup, launching (spawn, torchrun, ``paratrain run``) and
teardown are ddp's.

Training goes through ``rt.forward_backward(model, loss_fn, x, y)``, which runs forward and
backward together; ``model(x)`` works for evaluation, under ``torch.no_grad()``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.models.meta_init import is_meta
from paratrain.strategies.base import StrategyOptions
from paratrain.strategies.ddp import DDPStrategy
from paratrain.strategies.decoder_stages import tied_parameters
from paratrain.strategies.pipeline_plan import batchnorm_refusal, plan_stages
from paratrain.strategies.pipelined_model import SCHEDULES, LossFn, PipelinedModel
from paratrain.strategies.registry import register
from paratrain.utils.catalog import STRATEGIES
from paratrain.utils.errors import UserError

_DTYPES = {"bf16": torch.bfloat16}


@register
class PipelineStrategy(DDPStrategy):
    name = "pipeline"
    syncs_batchnorm = False
    checks_model = True
    collective_forward = True
    trains_in_pipeline = True
    builds_parts = True
    description = STRATEGIES["pipeline"]

    def __init__(self, devices: list[torch.device], options: StrategyOptions | None = None) -> None:
        super().__init__(devices, options)
        options = self.options
        refused = self.precision_refused(options.precision)
        if refused is not None:
            raise UserError(refused)
        if options.pipeline_schedule not in SCHEDULES:
            raise UserError(
                f"--pipeline-schedule {options.pipeline_schedule!r}: use one of "
                f"{', '.join(SCHEDULES)}"
            )
        if options.pipeline_microbatches < 1:
            raise UserError(
                f"--pipeline-microbatches must be at least 1, got {options.pipeline_microbatches}"
            )
        if self.collective.world_size < 2:
            raise UserError(
                "--strategy pipeline needs at least 2 processes, one per stage; give "
                "--devices 2 (GPUs, or CPU processes where there is no GPU) or cpu,cpu"
            )
        self._stage_parameters: list[nn.Parameter] = []

    def compile_refused(self) -> str | None:
        return (
            "--compile does not work with --strategy pipeline yet: its stages run inside "
            "torch.distributed.pipelining's schedule; drop --compile"
        )

    def precision_refused(self, precision: str) -> str | None:
        if precision == "fp16":
            # GradScaler skips a step on overflow per process; stages would then disagree.
            return (
                "--strategy pipeline with --precision fp16 needs a GradScaler shared by the "
                "stages, which paratrain does not have yet; use --precision bf16 or 32"
            )
        return None

    def oom_refused(self) -> str | None:
        return (
            "its schedule runs the forward and backward of every micro-batch together, the "
            "other stages waiting inside it; for less activation memory give more "
            "--pipeline-microbatches or --activation-checkpointing"
        )

    @property
    def data_shards(self) -> int:
        return 1  # every stage sees the whole batch: the first its inputs, the last its targets

    @property
    def data_rank(self) -> int:
        return 0

    @property
    def data_leaders(self) -> list[int]:
        # every stage holds the same batch (and gets the same output): the pipeline counts once
        return [0]

    def check_model(self, model: nn.Module) -> None:
        self._refuse_batchnorm(model)
        plan_stages(model, self.collective.world_size, self.options.pipeline_split)

    def _refuse_batchnorm(self, model: nn.Module) -> None:
        refused = batchnorm_refusal(model, self.options.pipeline_microbatches)
        if refused is not None:
            raise UserError(refused)

    def place_model(self, model: nn.Module) -> None:
        """Nothing: ``wrap_model`` moves only this process's stage to its device."""

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._refuse_batchnorm(model)
        count, index = self.collective.world_size, self.collective.rank
        stages = plan_stages(model, count, self.options.pipeline_split)
        full_shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
        if self.meta_init is not None and is_meta(model):  # only this stage gets storage
            self.meta_init.materialize([stages[index]])
        tied = tied_parameters(stages)  # a head tied to the embedding: first and last stage
        # every process makes the group (a collective); only the two stages use it
        group = dist.new_group([0, count - 1]) if tied and count > 2 else None
        mine = index in (0, count - 1)
        pipelined = PipelinedModel(
            stages[index],
            index,
            count,
            self.root_device,
            full_shapes,
            self.options.pipeline_schedule,
            self.options.pipeline_microbatches,
            _DTYPES.get(self.options.precision),
            tied if mine else (),
            group,
        )
        self._stage_parameters = list(pipelined.parameters())
        return pipelined.to(self.root_device)

    def rebind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Other stages' parameters become empty placeholders (on the meta device): they get
        no gradient, so the optimizer never steps or keeps state for them, and its state
        dict still numbers every parameter as a one-process run's does."""
        mine = {id(p) for p in self._stage_parameters}
        for group in optimizer.param_groups:
            group["params"] = [
                p if id(p) in mine else nn.Parameter(torch.empty_like(p, device="meta"))
                for p in group["params"]
            ]
        for param in list(optimizer.state):
            if id(param) not in mine:
                del optimizer.state[param]

    def train_step(
        self, model: nn.Module, inputs: Any, target: Any, loss_fn: LossFn | None, scale: float
    ) -> torch.Tensor | None:
        if not isinstance(model, PipelinedModel):
            raise UserError(
                "rt.forward_backward under --strategy pipeline needs the model rt.setup returned"
            )
        return model.train_step(inputs, target, loss_fn, scale)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "pipeline_split": list(self.options.pipeline_split),
            "pipeline_schedule": self.options.pipeline_schedule,
            "pipeline_microbatches": self.options.pipeline_microbatches,
        }
