"""Loaders that keep their own position: torchdata's ``StatefulDataLoader``.

``rt.setup_loader`` rebuilds a loader around its own batch sampler (the same global batches
on every layout). A ``StatefulDataLoader`` is rebuilt as one, so that its ``state_dict()``
and ``load_state_dict()`` still work (through the loader ``rt.setup_loader`` returns), and
its samplers, which are torchdata's own classes rather than torch's, are read as torch's:
its ``RandomSampler`` is a shuffle, its ``SequentialSampler`` none.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

_STATEFUL_MODULE = "torchdata.stateful_dataloader"


def _from_torchdata(obj: Any, name: str) -> bool:
    kind = type(obj)
    return kind.__name__ == name and kind.__module__.startswith(_STATEFUL_MODULE)


def shuffles(sampler: Any) -> bool:
    """A shuffle: torch's ``RandomSampler`` or torchdata's."""
    return isinstance(sampler, RandomSampler) or _from_torchdata(sampler, "RandomSampler")


def splittable(sampler: Any) -> bool:
    """A sampler whose order paratrain can reproduce across processes: a shuffle or none."""
    sequential = isinstance(sampler, SequentialSampler)
    return shuffles(sampler) or sequential or _from_torchdata(sampler, "SequentialSampler")


def loader_class(loader: DataLoader[Any]) -> type[DataLoader[Any]]:
    """The class a rebuilt loader is made of: a ``StatefulDataLoader`` stays one (it takes
    DataLoader's own arguments); any other loader becomes a plain ``DataLoader``."""
    if keeps_position(loader):
        return type(loader)
    return DataLoader


def keeps_position(loader: DataLoader[Any]) -> bool:
    """A loader with a position of its own to save (its batches must come from it, not be
    cut out of its tensors)."""
    return _from_torchdata(loader, "StatefulDataLoader")
