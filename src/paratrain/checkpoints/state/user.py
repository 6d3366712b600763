"""``rt.save`` / ``rt.load``: a checkpoint of what the user chooses, from their own loop.

One ``torch.save`` file: modules as plain state dicts (no ``module.``/``_orig_mod.``),
optimizers, LR schedulers and GradScalers as their ``state_dict()``, tensors on the CPU,
plain values as they are, and every process's generator states under a reserved key.
Saved inside an accumulation group, the group's gradients and position as well
(:mod:`paratrain.checkpoints.state.group`). Written once, by the main process, atomically;
read by every process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from paratrain.checkpoints.files import load_weights
from paratrain.checkpoints.files.readers import read_torch
from paratrain.checkpoints.state.collect import gather_to_main
from paratrain.checkpoints.state.group import GroupPosition, capture_group, restore_group
from paratrain.checkpoints.state.rng import capture_rng, restore_rng
from paratrain.checkpoints.state.sharded import (
    load_optimizer_state,
    model_state,
    optimizer_state,
)
from paratrain.checkpoints.weights import plain_state_dict
from paratrain.distributed.collective import Collective
from paratrain.utils.atomic import atomic_write
from paratrain.utils.errors import UserError

RESERVED = "__paratrain__"
_PLAIN = (int, float, str, bool, type(None))


class GroupState(Protocol):
    """Where the loader's accumulation group stands (the runtime's step state)."""

    accumulate: int

    def resume_group(self, micro_steps: int, sync_gradients: bool) -> None: ...


def save_state(
    collective: Collective,
    devices: Sequence[torch.device],
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    group: GroupPosition | None = None,
) -> Path:
    """Write ``state`` to ``path`` (see the module doc). Every process must call it, with
    the devices whose generators it uses; it returns once the file is complete, on every
    process. ``group``: saved inside an accumulation group (micro-batches done > 0)."""
    path = Path(path)
    if RESERVED in state:
        raise UserError(f"rt.save: the key {RESERVED!r} is reserved; rename that entry")
    for key, value in state.items():
        _check(key, value)
    # Sharded (FSDP) models and optimizers are gathered whole by every process.
    record = None if group is None else capture_group(collective, state, group)
    ready = {key: _gathered(collective, value) for key, value in state.items()}
    rngs = gather_to_main(collective, capture_rng(devices))
    if rngs is not None:
        payload = {str(key): _saveable(value) for key, value in ready.items()}
        payload[RESERVED] = {"format": 1, "world_size": collective.world_size, "rng": rngs}
        if record is not None:
            payload[RESERVED]["group"] = record
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: torch.save(payload, tmp))
    collective.barrier()
    return path


def load_state(
    collective: Collective,
    devices: Sequence[torch.device],
    path: str | os.PathLike[str],
    into: Mapping[str, Any] | None = None,
    rng: bool = True,
    group: GroupState | None = None,
) -> dict[str, Any]:
    """Read a file ``rt.save`` wrote; load its entries into the objects of ``into`` (same
    keys); restore this process's generators when ``rng`` and the world size is the same;
    a file saved inside an accumulation group gives ``into``'s modules the group's
    gradients and ``group`` its position. Returns every saved entry (tensors on the CPU),
    plain values included."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"rt.load: no such file: {path}")
    raw = read_torch(path)
    if not isinstance(raw, dict) or RESERVED not in raw:
        raise UserError(f"rt.load: {path} was not written by rt.save")
    meta = raw.pop(RESERVED)
    for key, target in (into or {}).items():
        if key not in raw:
            saved = ", ".join(map(repr, raw)) or "nothing"
            raise UserError(f"rt.load: {path} holds no {key!r}; it holds {saved}")
        _load_into(key, target, raw[key])
    record = meta.get("group")
    if record is not None and group is not None:
        at = restore_group(collective, record, into or {}, group.accumulate)
        if at is not None:
            group.resume_group(at.micro_steps, at.sync_gradients)
    if rng:
        if meta["world_size"] == collective.world_size:
            restore_rng(meta["rng"][collective.rank], devices)
        else:
            collective.note(
                f"paratrain: note: {path} was saved by {meta['world_size']} process(es), this "
                f"run has {collective.world_size}: random generator states not restored"
            )
    return raw


def _check(key: Any, value: Any) -> None:
    """Refuse what cannot be saved, on every process alike (before any collective)."""
    if isinstance(value, (nn.Module, torch.Tensor, *_PLAIN)) or callable(
        getattr(value, "state_dict", None)
    ):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check(key, item)
        return
    if isinstance(value, Mapping):
        for item in value.values():
            _check(key, item)
        return
    raise UserError(
        f"rt.save: {key!r} is a {type(value).__name__}; save modules, optimizers, LR "
        "schedulers, GradScalers, tensors, or numbers, strings, lists and dicts of them"
    )


class _Gathered:
    """A state already made plain and full (None on the processes that do not write)."""

    def __init__(self, state: Any) -> None:
        self.state = state


def _gathered(collective: Collective, value: Any) -> Any:
    if isinstance(value, nn.Module):
        return _Gathered(model_state(collective, value))
    if isinstance(value, torch.optim.Optimizer):
        return _Gathered(optimizer_state(collective, value))
    return value


def _saveable(value: Any) -> Any:
    if isinstance(value, _Gathered):
        return value.state
    if isinstance(value, nn.Module):
        return plain_state_dict(value)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, list):
        return [_saveable(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_saveable(item) for item in value)
    if isinstance(value, Mapping):
        return {key: _saveable(item) for key, item in value.items()}
    return value.state_dict()


def _load_into(key: str, target: Any, saved: Any) -> None:
    if isinstance(target, nn.Module):
        load_weights(target, saved)
    elif isinstance(target, torch.optim.Optimizer):
        load_optimizer_state(target, saved)
    elif isinstance(target, torch.Tensor):
        with torch.no_grad():
            target.copy_(saved)
    elif callable(getattr(target, "load_state_dict", None)):
        target.load_state_dict(saved)
    else:
        raise UserError(
            f"rt.load: cannot load {key!r} into a {type(target).__name__}; pass modules, "
            "optimizers, schedulers, GradScalers or tensors (plain values are returned)"
        )
