"""The loader ``rt.setup_loader`` makes of an iterable data set: this process's part of
each global batch (:mod:`paratrain.data.iterable_split`), with its loss weight, on the
device.

It behaves as a map-style loader does: ``set_epoch(epoch, start_batch)`` starts an epoch
mid-way (a resumed run), ``state_dict()`` says where training stands in the data (the same
on every process: the epoch and the global batches of it handed out), ``len()`` is known
where the data set tells its length, and the epoch's last batch carries ``ends_epoch``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from paratrain.data.iterable_split import GlobalBatches, Part
from paratrain.data.loaders import BatchSink, DeviceLoader


class StreamLoader(DeviceLoader):
    """A DataLoader of :class:`GlobalBatches` (its items are :class:`Part`)."""

    def __init__(
        self,
        loader: DataLoader[Any],
        device: torch.device,
        loss_weight_sink: BatchSink | None = None,
    ) -> None:
        super().__init__(loader, device, None, loss_weight_sink)
        assert isinstance(loader.dataset, GlobalBatches)
        self.stream: GlobalBatches = loader.dataset
        self._start = 0

    @property
    def evaluation(self) -> bool:
        return self.stream.evaluation

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Pin the next iteration to ``epoch``, from its global batch ``start_batch``."""
        super().set_epoch(epoch, start_batch)
        self._start = start_batch
        self._epoch_set_by_user = True

    def _next_start(self) -> int:
        return self._start if self._epoch_set_by_user else 0

    def _begin_epoch(self) -> None:
        self.stream.epoch = self._next_epoch
        self.stream.start_batch = self._next_start()
        self._next_epoch += 1

    def _start_batch(self) -> int:
        return self.stream.start_batch

    def _seeks(self) -> bool:
        return True

    def __len__(self) -> int:
        length = self.stream.num_batches(self._next_start())
        if length is None:
            raise TypeError(
                f"a loader of {type(self.stream.dataset).__name__} has no length: the data set "
                "has no __len__ (its epoch ends where its stream does)"
            )
        return length

    def _known_length(self) -> int | None:
        return self.stream.num_batches(self.stream.start_batch)

    def _weighted_batches(self) -> Iterator[tuple[Any, float]]:
        for part in self.loader:
            assert isinstance(part, Part)
            yield part.batch, part.weight
