"""Pipeline parallelism: the model's layers split into stages, one process per device, each
holding only its stage's parameters, gradients and optimizer state.

Every process reads the same global batch; the first stage feeds the inputs, the last
computes the loss, and torch.distributed.pipelining's schedule (1F1B by default, or GPipe)
runs the batch's micro-batches through the stages. Where the model is cut:
:mod:`.pipeline_plan`. Process setup, launching (spawn, torchrun, ``paratrain run``) and
teardown are ddp's.

``replicate=R``: R copies of a pipeline of N/R stages, a ("replicate", "stage") mesh
(:mod:`paratrain.distributed.mesh`, one copy's stages consecutive ranks). Each copy trains
on its 1/R part of each global batch, its part's loss weighted as ddp weights a process's
(:class:`paratrain.data.loaders.ShardedBatchSampler`); after the backward each stage averages
its gradients with the same stage of the other copies, which makes them one process's.

Training goes through ``rt.forward_backward(model, loss_fn, x, y)``, which runs forward and
backward together; ``model(x)`` works for evaluation, under ``torch.no_grad()``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.mesh import STAGE, coordinates, device_mesh, mesh_shape, place
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
        if self.stages < 2:
            raise UserError(
                f"--replicate {options.replicate} leaves one process per copy of the pipeline, "
                "which needs at least 2 stages; use --strategy ddp, or a --replicate that "
                "leaves 2 or more processes per copy"
            )
        self._stage_parameters: list[nn.Parameter] = []
        #: the same stage's processes in every copy (None: one copy)
        self._copies_group: Any = None

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
    def stages(self) -> int:
        """The stages of one pipeline (the processes of one copy); refuses a ``replicate``
        that does not divide the processes."""
        return mesh_shape(self.collective.world_size, self.options.replicate)[-1]

    @property
    def data_shards(self) -> int:
        # every stage of a copy sees its part: the first its inputs, the last its targets
        return self.options.replicate

    @property
    def data_rank(self) -> int:
        return self._place[0]

    @property
    def data_leaders(self) -> list[int]:
        # a copy's stages hold the same batch (and get the same output): each copy counts once
        return [copy * self.stages for copy in range(self.options.replicate)]

    @property
    def place(self) -> str:
        world = self.collective.world_size
        return place(self.collective.rank, world, self.options.replicate, inner=STAGE)

    @property
    def _place(self) -> tuple[int, int]:
        """This process's (copy, stage)."""
        return coordinates(self.collective.rank, self.collective.world_size, self.options.replicate)

    def check_model(self, model: nn.Module) -> None:
        self._refuse_batchnorm(model)
        plan_stages(model, self.stages, self.options.pipeline_split)

    def _refuse_batchnorm(self, model: nn.Module) -> None:
        refused = batchnorm_refusal(model, self.options.pipeline_microbatches)
        if refused is not None:
            raise UserError(refused)

    def place_model(self, model: nn.Module) -> None:
        """Nothing: ``wrap_model`` moves only this process's stage to its device."""

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._refuse_batchnorm(model)
        count, (copy, index) = self.stages, self._place
        stages = plan_stages(model, count, self.options.pipeline_split)
        full_shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
        if self.meta_init is not None and is_meta(model):  # only this stage gets storage
            self.meta_init.materialize([stages[index]])
        tied = tied_parameters(stages)  # a head tied to the embedding: first and last stage
        stage_group = self._make_mesh()
        first = copy * count
        group = None  # two stages, one copy: the default group is those two
        if tied and (count > 2 or stage_group is not None):
            # every process makes each copy's group (a collective); only its two stages use it
            ends = [[c * count, c * count + count - 1] for c in range(self.options.replicate)]
            group = [dist.new_group(pair) for pair in ends][copy]
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
            stage_group,
            first,
        )
        self._stage_parameters = list(pipelined.parameters())
        return pipelined.to(self.root_device)

    def _make_mesh(self) -> Any:
        """Under ``replicate``: the ("replicate", "stage") mesh; keeps the group of this
        stage's copies and returns this copy's stages' (None: one copy, every process)."""
        if self.options.replicate == 1:
            return None
        world = self.collective.world_size
        mesh = device_mesh(self.root_device.type, world, self.options.replicate, inner=STAGE)
        self._copies_group = mesh.get_group("replicate")
        return mesh.get_group(STAGE)

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
        loss = model.train_step(inputs, target, loss_fn, scale)
        if self._copies_group is None:
            return loss
        average_gradients(self._stage_parameters, self._copies_group, self.options.replicate)
        return None if loss is None else weighted_loss(loss, scale, self._copies_group)

    def describe(self) -> dict[str, Any]:
        described = {
            **super().describe(),
            "pipeline_split": list(self.options.pipeline_split),
            "pipeline_schedule": self.options.pipeline_schedule,
            "pipeline_microbatches": self.options.pipeline_microbatches,
        }
        if self.options.replicate > 1:
            described["mesh"] = {"replicate": self.options.replicate, STAGE: self.stages}
        return described


def average_gradients(params: list[nn.Parameter], group: Any, copies: int) -> None:
    """Each gradient the mean of the copies' (one all-reduce per dtype). A copy's gradients
    are ``loss weight`` x its part's mean loss's, the weights making the mean over the copies
    the whole batch's; a gradient held from an earlier micro-step of accumulation is the same
    in every copy, so its mean is itself."""
    grads = [p.grad for p in params if p.grad is not None]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        flat /= copies
        for grad, part in zip(same, flat.split([g.numel() for g in same]), strict=True):
            grad.copy_(part.view_as(grad))


def weighted_loss(loss: torch.Tensor, scale: float, group: Any) -> torch.Tensor:
    """The whole batch's mean loss from the copies' last stages: each part's mean weighted
    by its ``scale`` (its share of the batch; 0 for a stand-in sample)."""
    pair = torch.stack([loss * scale, torch.full_like(loss, scale)]).double()
    dist.all_reduce(pair, group=group)
    return (pair[0] / pair[1]).to(loss.dtype) if pair[1] > 0 else loss
