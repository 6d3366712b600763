"""Fully sharded data parallel (PyTorch's FSDP2, ``fully_shard``): one process per device,
and each holds only its shard of the parameters, gradients and optimizer state.

Process setup, launching (spawn, torchrun, ``paratrain run``), collectives and teardown are
ddp's; only the model wrapping differs. Each block (see :mod:`.blocks`) becomes one FSDP
unit, then the root. Gradients are reduce-scattered and averaged over the processes like
ddp's all-reduce, so the loss weights of uneven last batches are the same.

HSDP (``replicate=R``): the processes form an R x (N/R) mesh (:mod:`paratrain.distributed.mesh`);
each row of N/R consecutive ranks shards the model as above, and the rows are replicas:
gradients are reduce-scattered within a row, then all-reduced across rows, averaged over
all N processes as before. Data stays split over all N processes.

Tensor parallel (``tp=T``): the processes form an (N/T) x T mesh ``("shard", "tp")``; each
row of T consecutive ranks splits the layers (:mod:`.tensor_parallel`: the built-in GPT and
Hugging Face decoders with a plan) and sees the same batches, and fsdp shards what each holds
over the N/T rows, which split the data.

Mixed precision: under ``bf16``/``fp16`` the parameters are gathered in that dtype
(``MixedPrecisionPolicy``) and gradients reduced in float32; the sharded parameters and the
optimizer stay float32. paratrain's autocast still wraps the forward, so the operations it
keeps in float32 (softmax, norms, losses) stay there; the weights are already in the low
dtype, so autocast makes no second copy of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paratrain.distributed.dtensors import shard_like
from paratrain.distributed.mesh import SHARD, TP, device_mesh, mesh_names, mesh_shape, place
from paratrain.models.meta_init import MetaInit, is_meta, release
from paratrain.strategies.base import StrategyOptions
from paratrain.strategies.blocks import choose_blocks, has_parameters
from paratrain.strategies.ddp import DDPStrategy
from paratrain.strategies.registry import register
from paratrain.strategies.tensor_parallel import check_tp_model, parallelize, shard_placement
from paratrain.utils.catalog import STRATEGIES
from paratrain.utils.errors import UserError

if TYPE_CHECKING:  # torch.distributed.fsdp loads torch.distributed.tensor: imported when used
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@register
class FSDPStrategy(DDPStrategy):
    name = "fsdp"
    syncs_batchnorm = False
    checks_model = True
    collective_forward = True
    pieces_sync_each = True
    builds_parts = True
    description = STRATEGIES["fsdp"]
    # eager autograd.grad would run its reduce-scatter
    gathers_shards = True
    compile_check_refused = "under fsdp the eager pass would run the sharding hooks too"

    def __init__(self, devices: list[torch.device], options: StrategyOptions | None = None) -> None:
        super().__init__(devices, options)
        refused = self.precision_refused(self.options.precision)
        if refused is not None:
            raise UserError(refused)
        self._shape = mesh_shape(  # refused if uneven
            self.collective.world_size, self.options.replicate, self.options.tp
        )
        #: id of each parameter before sharding -> the sharded parameter replacing it
        self._replaced: dict[int, nn.Parameter] = {}

    @property
    def place(self) -> str:
        world = self.collective.world_size
        return place(self.collective.rank, world, self.options.replicate, self.options.tp)

    def precision_refused(self, precision: str) -> str | None:
        if precision == "fp16" and self.root_device.type == "cuda":
            # GradScaler skips a step on overflow per process; shards would then disagree.
            return (
                "--strategy fsdp with --precision fp16 on CUDA needs a sharded GradScaler, "
                "which paratrain does not have yet; use --precision bf16"
            )
        return None

    def check_model(self, model: nn.Module) -> None:
        if not has_parameters(model):
            raise UserError(
                f"--strategy fsdp shards parameters, and {type(model).__name__} has none; "
                "use --strategy ddp or cpu"
            )
        choose_blocks(model, self.options.fsdp_blocks)  # unknown --fsdp-blocks names
        if self.options.tp > 1:
            check_tp_model(model, self.options.tp, self._shape[0])

    def mp_policy(self) -> MixedPrecisionPolicy:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtype = _DTYPES.get(self.options.precision)
        if dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        self.check_model(model)
        before = {name: param for name, param in model.named_parameters()}
        world_size, replicate, tp = (
            self.collective.world_size,
            self.options.replicate,
            self.options.tp,
        )
        mesh = device_mesh(self.root_device.type, world_size, replicate, tp)
        init = self.meta_init if is_meta(model) else None
        shard: dict[str, Any] = {"mesh": mesh, "mp_policy": self.mp_policy()}
        if tp > 1:  # the layers split first, then fsdp shards each process's part
            _materialized(init, model)
            init = None
            parallelize(model, mesh[TP])
            shard.update(mesh=mesh[SHARD], shard_placement_fn=shard_placement)
        for block in choose_blocks(model, self.options.fsdp_blocks):
            # a meta model: one whole block at a time, freed once its shard is kept
            whole = _materialized(init, block)
            fully_shard(block, **shard)
            release(whole)
        whole = _materialized(init, model)  # what no block holds
        fully_shard(model, **shard)
        release(whole)
        after = dict(model.named_parameters())
        self._replaced = {id(param): after[name] for name, param in before.items()}
        return model

    def place_model(self, model: nn.Module) -> None:
        if not is_meta(model):  # a meta model's blocks are materialised in wrap_model
            super().place_model(model)

    def rebind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` (built from the unsharded parameters) at the sharded ones,
        with its state, if any, cut to this process's shard."""
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(id(p), p) for p in group["params"]]
        for old in list(optimizer.state):
            new = self._replaced.get(id(old))
            if new is not None and new is not old:
                entry = optimizer.state.pop(old)
                optimizer.state[new] = {
                    key: shard_like(value, new)
                    if isinstance(value, torch.Tensor) and value.shape == new.shape
                    else value
                    for key, value in entry.items()
                }

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return _without_gradient_sync(model)
        return contextlib.nullcontext()

    def describe(self) -> dict[str, Any]:
        described = {**super().describe(), "fsdp_blocks": list(self.options.fsdp_blocks)}
        if len(self._shape) > 1:
            names = mesh_names(self._shape, self.options.tp)
            described["mesh"] = dict(zip(names, self._shape, strict=True))
        return described

    @property
    def _tp(self) -> int:
        return self.options.tp

    @property
    def data_shards(self) -> int:
        return self.collective.world_size // self._tp  # a tp group takes one part

    @property
    def data_rank(self) -> int:
        return self.collective.rank // self._tp

    @property
    def data_leaders(self) -> list[int]:
        return list(range(0, self.collective.world_size, self._tp))


def _materialized(init: MetaInit | None, module: nn.Module) -> list[torch.Tensor]:
    """Materialise ``module``'s meta tensors with ``init``; the tensors it made real."""
    if init is None:
        return []
    pending = [t for t in [*module.parameters(), *module.buffers()] if t.is_meta]
    init.materialize([module])
    return [t for t in pending if not t.is_meta]


@contextlib.contextmanager
def _without_gradient_sync(model: FSDPModule) -> Iterator[None]:
    """FSDP's ``no_sync``: gradients stay unsharded and summed locally until a micro-batch
    runs with synchronization again."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
