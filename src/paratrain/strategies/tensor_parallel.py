"""Tensor parallelism (``--tp N``) for paratrain's built-in GPT (:mod:`paratrain.models.gpt`)
and for Hugging Face decoders with a plan of their own (:mod:`.decoder_tp`): each block's
layers split across the N processes of a ``tp`` group, with torch's ``parallelize_module``,
before fsdp shards what each process holds (torchtitan's order).

The plan, per block: the fused ``qkv`` column-wise by heads (each process computes its
heads/N heads' queries, keys and values; the block reads its local head count), ``proj``
row-wise (its partial sums all-reduced), the MLP's first layer column-wise and its second
row-wise. Embeddings, positions, norms and the head stay whole on every process of the group.

``qkv``'s rows are ``[q | k | v]``, so a contiguous split would cut across them: its weight is
split in each of the three parts (a ``_StridedShard`` of 3) and fsdp shards its other
dimension (the input's), so that the full tensor of a checkpoint is the plain weight.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, cast

from torch import Tensor, nn
from torch.nn import functional as F

from paratrain.models.gpt import GPT, TransformerBlock
from paratrain.strategies import decoder_tp
from paratrain.utils.errors import UserError

if TYPE_CHECKING:  # torch.distributed.tensor loads torch._dynamo: imported when used
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.distributed.tensor.placement_types import Placement

#: qkv's output holds three parts, each split by heads
_PARTS = 3


def check_tp_model(model: nn.Module, tp: int, shards: int) -> None:
    """``UserError`` unless ``model`` is the built-in GPT and its widths split into ``tp``
    groups (heads) and ``shards`` fsdp shards (qkv's input width), or a Hugging Face decoder
    whose plan applies (:func:`.decoder_tp.check`)."""
    if decoder_tp.is_decoder(model):
        decoder_tp.check(model, tp, shards)
        return
    if not isinstance(model, GPT):
        raise UserError(
            f"--tp has a plan for paratrain's built-in GPT (paratrain.models.gpt.GPT, "
            f"--recipe tiny-gpt) and Hugging Face decoders (Llama, Mistral, Qwen2) only, not "
            f"{type(model).__name__}; drop --tp"
        )
    for block in _blocks(model):
        heads, width = block.heads, block.qkv.in_features
        if heads % tp:
            raise UserError(
                f"--tp {tp} does not divide the GPT's {heads} attention heads; use a --tp "
                f"that divides {heads}"
            )
        if width % shards:
            raise UserError(
                f"--tp {tp} leaves {shards} fsdp shards, which do not divide the GPT's width "
                f"{width}; use a --tp that does"
            )


def parallelize(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split ``model``'s blocks across the processes of ``mesh`` (one dimension, ``tp``)."""
    if isinstance(model, GPT):
        _parallelize_gpt(model, mesh)
    else:
        decoder_tp.parallelize(model, mesh)
    # a checkpoint's full tensors gather fsdp's and tp's shards one dimension after the
    # other; torch warns of the second collective (a reduction order would matter, a
    # gather's does not)
    said = logging.getLogger("torch.distributed.tensor._redistribute")
    if _gathers_in_turn not in said.filters:
        said.addFilter(_gathers_in_turn)


def _parallelize_gpt(model: GPT, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, ParallelStyle] = {}
    for index, block in enumerate(_blocks(model)):
        prefix = f"blocks.{index}."
        plan[prefix + "qkv"] = _heads_colwise()
        plan[prefix + "proj"] = RowwiseParallel()
        plan[prefix + "mlp.0"] = ColwiseParallel()
        plan[prefix + "mlp.2"] = RowwiseParallel()
        block.heads //= mesh.size()  # the heads this process computes
    parallelize_module(model, mesh, plan)


def one_process_part(model: GPT, tp: int) -> GPT:
    """``model`` cut to what one process of a group of ``tp`` holds and computes, as plain
    layers (``paratrain plan`` traces it): each block's qkv, proj and MLP layers 1/tp as wide
    on the side ``parallelize`` splits, its heads 1/tp, the rest whole."""
    for block in _blocks(model):
        width, hidden = block.qkv.in_features, cast(nn.Linear, block.mlp[0]).out_features
        block.qkv = nn.Linear(width, _PARTS * width // tp)
        block.proj = nn.Linear(width // tp, width)
        block.mlp[0] = nn.Linear(width, hidden // tp)
        block.mlp[2] = nn.Linear(hidden // tp, width)
        block.heads //= tp
    return model


def _gathers_in_turn(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("sequential all_gather" in message and "to (Replicate(), Replicate())" in message)


def _blocks(model: GPT) -> list[TransformerBlock]:
    return [cast(TransformerBlock, block) for block in model.blocks]


def shard_placement(param: nn.Parameter) -> Shard | None:
    """fsdp's placement of ``param`` (its ``shard_placement_fn``): qkv's weight along its
    input dimension, which tensor parallelism leaves whole; the default elsewhere."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(param, DTensor) and isinstance(param.placements[0], _StridedShard):
        return Shard(1)
    return None


def _heads_colwise() -> ParallelStyle:
    from torch.distributed.tensor.parallel import ParallelStyle

    class HeadsColwise(ParallelStyle):
        """Column-wise by heads for a fused ``[q | k | v]`` projection."""

        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            from torch.distributed.tensor import Replicate, distribute_tensor

            assert isinstance(module, nn.Linear)
            rows = distribute_tensor(module.weight, device_mesh, [_rows()], src_data_rank=None)
            module.weight = nn.Parameter(rows)
            if module.bias is not None:  # whole: sliced in the forward (see _fused_forward)
                whole = distribute_tensor(module.bias, device_mesh, [Replicate()])
                module.bias = nn.Parameter(whole)
            module.forward = functools.partial(_fused_forward, module, device_mesh)  # type: ignore[method-assign]
            return module

    return HeadsColwise()


def _rows() -> Placement:
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(0, split_factor=_PARTS)


def _fused_forward(module: nn.Linear, mesh: DeviceMesh, x: Tensor) -> Tensor:
    """This process's heads of ``module``'s output, ``[q_r | k_r | v_r]``."""
    # every process of the group holds the same x; each one's gradient for it covers its
    # heads only, so the backward sums them over the group
    local_x = _summed_back(x, mesh)
    bias = None
    if module.bias is not None:  # this process's slice of the whole bias, cut by hand
        # (a redistribute to the weight's _StridedShard fails on some torch versions); the
        # slice's gradient is zero elsewhere, and summed over the group is the whole one
        whole = _summed_back(cast("DTensor", module.bias).to_local(), mesh)
        bias = whole.view(_PARTS, mesh.size(), -1)[:, mesh.get_local_rank()].reshape(-1)
    return F.linear(local_x, cast("DTensor", module.weight).to_local(), bias)


def _summed_back(tensor: Tensor, mesh: DeviceMesh) -> Tensor:
    """``tensor``, held whole by every process of ``mesh``, whose gradient is summed over
    the processes in the backward (an all-reduce)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    whole = DTensor.from_local(tensor, mesh, [Replicate()], run_check=False)
    return whole.to_local(grad_placements=[Partial()])
