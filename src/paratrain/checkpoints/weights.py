"""Plain state dicts: no ``module.`` (DataParallel/DDP) or ``_orig_mod.`` (compile) prefixes."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from paratrain.distributed.dtensors import full, is_sharded
from paratrain.utils.atomic import atomic_write

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside any DataParallel, DDP or ``torch.compile`` wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and isinstance(
            model, (nn.DataParallel, nn.parallel.DistributedDataParallel)
        ):
            model = inner
            continue
        return model


def strip_prefixes(key: str) -> str:
    """Remove wrapper prefixes in any order and nesting: ``module._orig_mod.fc.w`` -> ``fc.w``."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                changed = True
    return key


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights on the CPU, with plain names, ready for safetensors.

    A sharded (FSDP) model's tensors are gathered whole: every process must call it then."""
    return plain_tensors(unwrap_model(model).state_dict())


def plain_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` on the CPU with wrapper prefixes stripped, ready for safetensors (sharded
    tensors gathered whole, a collective)."""
    plain: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in state.items():
        tensor = full(value.detach()).cpu().contiguous()
        if tensor.data_ptr() in seen:  # tied weights: safetensors refuses shared storage
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        plain[strip_prefixes(key)] = tensor
    return plain


def save_weights(model: nn.Module, path: str | Path) -> None:
    """Write ``model``'s plain state dict to ``path`` as safetensors, atomically. For a
    sharded (FSDP) model call it on every process: they gather the weights, the main one
    writes."""
    sharded = any(is_sharded(t) for t in unwrap_model(model).state_dict().values())
    state = plain_state_dict(model)
    if sharded and not _is_main():
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # as rt.save does
    atomic_write(path, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))


def _is_main() -> bool:
    return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0
