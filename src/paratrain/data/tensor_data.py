"""Data sets held in tensors, which a loader can cut into whole batches by indexing.

A data set serves whole batches when it is a :class:`~torch.utils.data.TensorDataset`
(whose class keeps TensorDataset's ``__getitem__``), or when it follows the batch protocol,
:class:`BatchRows`:

- ``tensors: tuple[Tensor, ...]``: one row per sample in each, equal first dimensions;
- ``transform_batch(rows: list[Tensor]) -> Any``: turns ``[t[index] for t in tensors]``
  into the batch the model gets. It must equal, bit for bit, what the default collate makes
  of ``[dataset[i] for i in index]`` (for tuples of tensors: a list), on any device: loaders
  apply it after the rows were moved to the device (uint8 images normalised there, say).
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import TensorDataset


@runtime_checkable
class BatchRows(Protocol):
    """A data set whose batches are rows of its tensors, transformed per batch."""

    tensors: tuple[torch.Tensor, ...]

    def transform_batch(self, rows: list[torch.Tensor]) -> Any: ...


@dataclass(frozen=True)
class TensorRows:
    """What a loader needs to cut batches: the tensors, and the per-batch transform."""

    tensors: tuple[torch.Tensor, ...]
    transform: Callable[[list[torch.Tensor]], Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to(self, device: torch.device) -> TensorRows:
        return TensorRows(tuple(t.to(device) for t in self.tensors), self.transform)


def tensor_rows(dataset: object) -> TensorRows | str:
    """The data set's tensors and transform, or why it cannot serve whole batches."""
    if isinstance(dataset, BatchRows):
        transform: Callable[[list[torch.Tensor]], Any] | None = dataset.transform_batch
    elif isinstance(dataset, TensorDataset):
        # A subclass that reads samples its own way would be bypassed by indexing.
        if type(dataset).__getitem__ is not TensorDataset.__getitem__:
            return (
                f"{type(dataset).__name__} overrides __getitem__; give it a "
                "transform_batch(rows) method (paratrain.data.tensor_data) to serve whole batches"
            )
        transform = None
    else:
        return (
            f"{type(dataset).__name__} is neither a TensorDataset nor exposes tensors and "
            "transform_batch (paratrain.data.tensor_data)"
        )
    tensors = tuple(dataset.tensors)
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors):
        return f"{type(dataset).__name__}.tensors is not a tuple of tensors with rows"
    rows = tensors[0].size(0)
    if any(t.size(0) != rows for t in tensors) or (
        isinstance(dataset, Sized) and len(dataset) != rows
    ):
        return f"the tensors of {type(dataset).__name__} do not have one row per sample"
    if any(t.device.type != "cpu" for t in tensors):
        return f"the tensors of {type(dataset).__name__} are not all on the CPU"
    return TensorRows(tensors, transform)
