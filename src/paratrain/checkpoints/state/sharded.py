"""Full states of models and optimizers whose tensors may be sharded (FSDP) or spread over
processes (a pipeline's stages each hold a part of the model).

A checkpoint always holds plain full tensors, whatever the layout, so that any layout can
load it. Gathering sharded tensors is a collective: every process calls these functions;
the main process gets the state, the others None. Without sharded tensors only the main
process copies anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from paratrain.checkpoints.state.collect import gather_to_main
from paratrain.checkpoints.weights import plain_state_dict, unwrap_model
from paratrain.distributed.collective import Collective
from paratrain.distributed.dtensors import full, is_sharded, shard_like
from paratrain.utils.atomic import atomic_write


def model_is_sharded(model: nn.Module) -> bool:
    return any(is_sharded(t) for t in unwrap_model(model).state_dict().values())


def model_is_part(model: nn.Module) -> bool:
    """Whether this process holds only a part of the model (a pipeline stage)."""
    return bool(getattr(unwrap_model(model), "holds_part_of_model", False))


def model_state(collective: Collective, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's plain full weights on the main process (None on the others)."""
    if model_is_part(model):
        parts = gather_to_main(collective, plain_state_dict(model))
        return None if parts is None else {k: v for part in parts for k, v in part.items()}
    if model_is_sharded(model):
        state = plain_state_dict(model)  # every process takes part in the gathers
        return state if collective.is_main else None
    return plain_state_dict(model) if collective.is_main else None


def optimizer_state(collective: Collective, optimizer: Any) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` with full tensors on the main process (None elsewhere):
    the same file a one-process run writes."""
    state = optimizer.state_dict()
    if _holds_other_parts(optimizer):  # each process steps its own part's parameters
        parts = gather_to_main(collective, state["state"])
        if parts is None:
            return None
        return {**state, "state": {k: v for part in parts for k, v in part.items()}}
    per_param = state["state"].values()
    if not any(is_sharded(v) for entry in per_param for v in entry.values()):
        return state if collective.is_main else None
    gathered = {
        index: {
            key: full(value).cpu() if is_sharded(value) else value for key, value in entry.items()
        }
        for index, entry in state["state"].items()
    }
    return {**state, "state": gathered} if collective.is_main else None


def load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``; state of sharded parameters becomes this
    process's shard of it."""
    optimizer.load_state_dict(state)
    for param in [p for p in optimizer.state if p.is_meta]:
        del optimizer.state[param]  # another pipeline stage's: that process loads it
    for param, entry in optimizer.state.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                entry[key] = shard_like(value, param)


def _holds_other_parts(optimizer: Any) -> bool:
    """Whether the optimizer keeps placeholders (on the meta device) for parameters that
    other processes hold: a pipeline stage's."""
    return any(p.is_meta for group in optimizer.param_groups for p in group["params"])


def save_model_weights(
    collective: Collective, model: nn.Module, path: str | os.PathLike[str]
) -> None:
    """``model``'s full plain weights to ``path`` (safetensors), written atomically by the
    main process. Every process calls it; all return once the file is complete."""
    state = model_state(collective, model)
    if state is not None:
        size = sum(t.numel() * t.element_size() for t in state.values())
        write = lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"})  # noqa: E731
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # as rt.save does
        atomic_write(Path(path), write, size=size)
    collective.barrier()
