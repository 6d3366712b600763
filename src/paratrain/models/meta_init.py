"""Models built on the meta device and given their weights part by part, the same in every
layout.

``paratrain train`` builds its recipe's model under ``torch.device("meta")``: shapes only,
no memory. :meth:`MetaInit.materialize` then gives real storage (on the CPU) to the part a
process holds, one module at a time: fsdp materialises one block, shards it and frees the
whole block before the next; pipeline only its own stage; the other layouts the whole model.

Each module's own parameters and buffers are initialised by its ``reset_parameters()``, then
by the model's ``init_module(module)`` if it has one (for what the model's constructor sets
itself, e.g. ResNet's Kaiming convolutions), under the CPU generator seeded from the run's
seed and the module's qualified name. A weight therefore depends on (seed, name) alone,
never on which other parts a process builds or in which order: every layout gets the weights
a one-process build gets. (Initialising after sharding, on the shards, would not: the random
draws would depend on the layout.) The global generators are left as they were.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from itertools import chain

import torch
from torch import nn

from paratrain.utils.errors import UserError


def is_meta(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters or buffers has no storage yet."""
    return any(t.is_meta for t in chain(model.parameters(), model.buffers()))


def module_seed(seed: int, name: str) -> int:
    """The generator seed of the module called ``name`` (``""``: the model itself)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


class MetaInit:
    """Materialises the parts of ``model`` (built on the meta device) that a process holds."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.model = model
        self.seed = seed
        #: id of each parameter and buffer -> the module that owns it and that module's name
        self._owners: dict[int, tuple[nn.Module, str]] = {}
        for name, module in model.named_modules():
            for _, tensor in _own_tensors(module):
                self._owners.setdefault(id(tensor), (module, name))

    def materialize(self, parts: Iterable[nn.Module]) -> None:
        """Give every meta tensor of ``parts`` (modules of the model, or modules holding
        its tensors, like a pipeline stage) storage on the CPU and its initial values.
        The tensors keep their identity: an optimizer built on the meta model stays valid."""
        owners: dict[int, tuple[nn.Module, str]] = {}
        for part in parts:
            for tensor in chain(part.parameters(), part.buffers()):
                owner = self._owners.get(id(tensor))
                if tensor.is_meta and owner is not None:
                    owners.setdefault(id(owner[0]), owner)
        for module, name in owners.values():
            self._materialize_own(module, name)

    def _materialize_own(self, module: nn.Module, name: str) -> None:
        own = [(key, t) for key, t in _own_tensors(module) if t.is_meta]
        for _, tensor in own:
            real = torch.empty_like(tensor, device="cpu")
            if real.is_floating_point():
                real.fill_(float("nan"))  # what no initialiser sets stays visible
            if isinstance(tensor, nn.Parameter):
                real = nn.Parameter(real, requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, real)
        init_module = getattr(self.model, "init_module", None)
        if init_module is None:  # Hugging Face's models initialise module by module
            init_module = getattr(self.model, "_init_weights", None)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.default_generator.manual_seed(module_seed(self.seed, name))
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            if callable(init_module):
                init_module(module)
        for key, tensor in own:
            if tensor.is_floating_point() and bool(tensor.isnan().any()):
                where = f"{name}.{key}" if name else key
                raise UserError(
                    f"{where} of the model built on the meta device was left uninitialised: "
                    f"give {type(module).__name__} a reset_parameters() method, or the model "
                    "an init_module(module) method that sets it"
                )


def release(tensors: Iterable[torch.Tensor]) -> None:
    """Free the storage of tensors nothing computes with any more (a block's whole
    parameters once fsdp holds its shard), keeping the objects: maps from them stay valid."""
    for tensor in tensors:
        if not tensor.is_meta:
            empty = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, nn.Parameter):
                empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, empty)
