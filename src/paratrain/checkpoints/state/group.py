"""An accumulation group cut by ``rt.save``: the gradients its first micro-batches summed,
and how many they were, so that ``rt.load`` continues the group where it stood.

Only a checkpoint saved inside a group (``StepState.micro_steps > 0``) holds them: ordinary
checkpoints do not grow. Every process's own gradients are kept (under ddp they are local
until the group's last micro-batch, which all-reduces them), by the module's key in the
saved dict and the parameters' plain names. Loaded by the same number of processes, each
gets its own back, bit for bit; by another number, each gets their mean over the processes
that held them, which is the same gradient once the group's all-reduce averages it (up to
rounding). Sharded (fsdp) models hold a group's gradients inside FSDP, unsharded and not
on the parameters: a checkpoint there is refused until the group ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.checkpoints.state.collect import gather_to_main
from paratrain.checkpoints.state.sharded import model_is_sharded
from paratrain.checkpoints.weights import strip_prefixes, unwrap_model
from paratrain.distributed.collective import Collective
from paratrain.utils.errors import UserError

#: a process's gradients: module key -> plain parameter name -> gradient (on the CPU)
Gradients = dict[str, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class GroupPosition:
    """Where an accumulation group stands: ``micro_steps`` of ``accumulate`` done, and
    whether the next ``optimizer.step()`` applies them (the group is complete)."""

    micro_steps: int
    accumulate: int
    sync_gradients: bool = False


def capture_group(
    collective: Collective, state: Mapping[str, Any], at: GroupPosition
) -> dict[str, Any] | None:
    """The group's record on the main process (None on the others): every process's
    gradients of the modules among ``state``'s entries. Every process must call it."""
    modules = _modules(state)
    for key, module in modules.items():
        # a group of Runtime(accumulate=N) holds its gradients inside FSDP; one made by hand
        # (accumulate=1) only where a backward left some on the parameters
        held = at.accumulate > 1 or any(p.grad is not None for p in module.parameters())
        if held and model_is_sharded(module):
            raise UserError(
                f"rt.save: {key!r} is sharded (fsdp) and the save comes after {at.micro_steps} "
                f"of the {at.accumulate} micro-batches of an accumulation group, whose "
                "gradients FSDP holds unsharded where they cannot be saved; save after the "
                "optimizer.step() that ends the group (when rt.sync_gradients was True)"
            )
    mine = {key: _gradients(module) for key, module in modules.items()}
    every = gather_to_main(collective, mine)
    if every is None:
        return None
    return {
        "micro_steps": at.micro_steps,
        "accumulate": at.accumulate,
        "sync_gradients": at.sync_gradients,
        "gradients": every,
    }


def restore_group(
    collective: Collective, record: Mapping[str, Any], into: Mapping[str, Any], accumulate: int
) -> GroupPosition | None:
    """Give the modules of ``into`` the group's gradients; returns where the group stands
    (None: it starts afresh, said in a note)."""
    every: list[Gradients] = record["gradients"]
    micro_steps, saved_accumulate = record["micro_steps"], record["accumulate"]
    keys = {key for gradients in every for key in gradients}
    missing = sorted(key for key in keys if not isinstance(into.get(key), nn.Module))
    where = f"after {micro_steps} of the {saved_accumulate} micro-batches of a group"
    if saved_accumulate != accumulate:
        collective.note(
            f"paratrain: note: the checkpoint was saved {where} (accumulate={saved_accumulate}"
            f"), this run has accumulate={accumulate}: its partly accumulated gradients are "
            "dropped and a new group starts"
        )
        return None
    if missing:
        collective.note(
            f"paratrain: note: the checkpoint was saved {where}; pass "
            f"{', '.join(map(repr, missing))} in rt.load(path, into=...) to continue the "
            "group: its partly accumulated gradients are dropped and a new group starts"
        )
        return None
    same = len(every) == collective.world_size
    for key in sorted(keys):
        module = into[key]
        if model_is_sharded(module):
            raise UserError(
                f"rt.load: the checkpoint was saved {where}, and {key!r} is sharded (fsdp) "
                "here: its gradients cannot be put back; resume it without fsdp"
            )
        mine = every[collective.rank].get(key, {}) if same else _mean(every, key)
        _set_gradients(module, mine)
    if not same:
        collective.note(
            f"paratrain: note: the checkpoint was saved {where} by {len(every)} process(es), "
            f"this run has {collective.world_size}: each continues the group with the mean "
            "of their gradients (the same step, up to rounding)"
        )
    return GroupPosition(micro_steps, accumulate, bool(record.get("sync_gradients", False)))


def _modules(state: Mapping[str, Any]) -> dict[str, nn.Module]:
    return {str(key): value for key, value in state.items() if isinstance(value, nn.Module)}


def _names(module: nn.Module) -> dict[int, str]:
    """Each parameter's plain name, as the saved weights name it."""
    named = unwrap_model(module).state_dict(keep_vars=True)
    return {id(tensor): strip_prefixes(key) for key, tensor in named.items()}


def _gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    names = _names(module)
    return {
        names[id(param)]: param.grad.detach().to("cpu", copy=True)
        for param in unwrap_model(module).parameters()
        if param.grad is not None and id(param) in names
    }


def _mean(every: list[Gradients], key: str) -> dict[str, torch.Tensor]:
    held: dict[str, list[torch.Tensor]] = {}
    for gradients in every:
        for name, gradient in gradients.get(key, {}).items():
            held.setdefault(name, []).append(gradient)
    return {name: torch.stack(parts).mean(dim=0) for name, parts in held.items()}


def _set_gradients(module: nn.Module, gradients: Mapping[str, torch.Tensor]) -> None:
    """The parameters' gradients become the saved ones (None where none was saved)."""
    names = _names(module)
    for param in unwrap_model(module).parameters():
        saved = gradients.get(names.get(id(param), ""))
        param.grad = None if saved is None else saved.to(param.device, param.dtype, copy=True)
