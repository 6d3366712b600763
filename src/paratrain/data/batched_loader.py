"""Batches cut out of tensors by index: no per-sample ``__getitem__``, no collate.

They are the DataLoader path's batches, bit for bit: the indices come from the same
:class:`~paratrain.data.loaders.ShardedBatchSampler` (its order and spans), ``index_select``
gathers exactly the rows that stacking the samples gives, and :class:`DeviceLoader`'s
iteration sets the loss weights and ``at_last_batch`` and advances epochs as it does for a
DataLoader. ``len()``, ``set_epoch(epoch, start_batch)`` and resuming therefore behave alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from paratrain.data.loaders import BatchSink, DeviceLoader, ShardedBatchSampler
from paratrain.data.placement import move_to_device
from paratrain.data.tensor_data import TensorRows


class TensorBatchLoader(DeviceLoader):
    """Cuts each batch out of the data set's tensors, in host memory or on the device.

    ``resident=False`` ("batched"): rows are gathered on the host (into pinned memory when
    the device is CUDA, then copied with ``non_blocking=True``) and the transform runs on the
    device. ``resident=True`` ("device"): the tensors are copied to ``device`` once, and
    batches are gathered there. Any device works; choosing where it pays is
    :mod:`paratrain.data.paths`' job.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        device: torch.device,
        batch_sampler: ShardedBatchSampler,
        rows: TensorRows,
        *,
        resident: bool,
        loss_weight_sink: BatchSink | None = None,
    ) -> None:
        super().__init__(loader, device, batch_sampler, loss_weight_sink)
        self._sampler = batch_sampler
        self.data_path = "device" if resident else "batched"
        self.rows = rows.to(device) if resident else rows
        self._pin = not resident and device.type == "cuda"

    def _batches(self) -> Iterator[Any]:
        # A DataLoader iterator draws its workers' base seed from the loader's generator (the
        # global one when it has none, unseeded): draw it too, so that the random stream is
        # consumed exactly as on that path.
        torch.empty((), dtype=torch.int64).random_(generator=self.loader.generator)
        order = self._sampler.order().to(self.rows.tensors[0].device)
        for start, end in self._sampler.spans():
            yield self._cut(order[start:end])
        self._sampler.end_epoch()

    def _cut(self, index: torch.Tensor) -> Any:
        if self._pin:
            rows = move_to_device([_pinned_rows(t, index) for t in self.rows.tensors], self.device)
        else:
            rows = [torch.index_select(t, 0, index) for t in self.rows.tensors]
            if rows[0].device != self.device:
                rows = move_to_device(rows, self.device)
        transform = self.rows.transform
        return rows if transform is None else transform(rows)


def _pinned_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[index]`` gathered straight into pinned memory: one host copy, where the
    DataLoader path collates and then pins a second. A fresh buffer per batch: the caching
    host allocator reuses it only once the copy that reads it has finished."""
    out = torch.empty((index.numel(), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=True)
    return torch.index_select(tensor, 0, index, out=out)
