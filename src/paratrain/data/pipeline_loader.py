"""The loader ``rt.setup_loader`` makes of a user's webdataset pipeline: this process's
shards (:mod:`paratrain.data.wds_pipeline`), its batches on the device, and the processes
stepping together although their parts differ in length.

Before each training batch the processes tell each other how many samples they hold (one
small all-gather). Each batch's loss weight is its share of the samples of that step
(``n_r * R / N``), so the processes' mean loss is the step's mean over its samples. A
process whose part has run out trains on a stand-in (its last batch again, weight 0) while
another still has samples; the epoch ends for all when every part has. So every sample is
trained on once an epoch, and every process takes the same number of steps.

``state_dict()`` is ``{"epoch", "batch"}`` (the steps of the epoch taken, the same on every
process). A resumed epoch reads this process's shards again from their start and passes
over the batches already trained on (a shuffle buffer cannot be saved): exact where the
pipeline draws the same order again (its shuffles seeded from the run's seed).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from paratrain.data.loaders import BatchSink, DeviceLoader
from paratrain.data.wds_pipeline import PipelinePart
from paratrain.utils.errors import UserError

#: every data part's count of samples, given this process's
CountSamples = Callable[[int], list[int]]


def batch_length(batch: Any) -> int:
    """How many samples ``batch`` holds: its first tensor's first dimension (1 without one)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    values = batch.values() if isinstance(batch, dict) else batch
    if isinstance(batch, (list, tuple, dict)):
        for value in values:
            if isinstance(value, (torch.Tensor, list, tuple, dict)):
                return batch_length(value)
    return 1


class PipelineLoader(DeviceLoader):
    """A DataLoader of a :class:`PipelinePart` (see the module)."""

    def __init__(
        self,
        loader: DataLoader[Any],
        device: torch.device,
        sink: BatchSink | None,
        count: CountSamples | None,
        evaluation: bool,
    ) -> None:
        super().__init__(loader, device, None, sink)
        assert isinstance(loader.dataset, PipelinePart)
        self.part: PipelinePart = loader.dataset
        self._count = count
        self._evaluation = evaluation
        self._start = 0

    @property
    def evaluation(self) -> bool:
        return self._evaluation

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Pin the next iteration to ``epoch``, after its first ``start_batch`` steps."""
        super().set_epoch(epoch, start_batch)
        self._start = start_batch
        self._epoch_set_by_user = True

    def _begin_epoch(self) -> None:
        self.part.epoch = self._next_epoch
        if not self._epoch_set_by_user:
            self._start = 0
        self._next_epoch += 1

    def _start_batch(self) -> int:
        return self._start

    def _seeks(self) -> bool:
        return True

    def __len__(self) -> int:
        raise TypeError(
            "a loader of a webdataset pipeline has no length: its processes' parts are "
            "known only once read (its epoch ends where the longest part does)"
        )

    def _known_length(self) -> int | None:
        return None

    def note(self, processes: int, workers: int) -> str:
        """What is and is not exact for this pipeline, in one line."""
        part = self.part
        if not part.bounded:
            return (
                "the webdataset pipeline draws its shards without end: no epoch ends, so "
                "count steps and evaluate and checkpoint by step; each process draws its "
                "own shards (no sample is once an epoch), and a resume continues the step "
                "count, not the stream"
            )
        resume = (
            "exact: its shuffle buffers are seeded from the run's seed"
            if part.seed is not None
            else "not exact: with no run seed its shuffle buffers draw from the clock"
        )
        return (
            f"the webdataset pipeline's {part.shards} shards go to {processes} process(es) "
            f"x {max(workers, 1)} worker(s) (shard i to process i % {processes}), each "
            "sample once an epoch (a process that runs out trains on weight-0 stand-ins "
            "until all have; the batches depend on the layout); a resume reads the epoch's "
            f"shards again and passes over the batches trained on, {resume}"
        )

    def _weighted_batches(self) -> Iterator[tuple[Any, float]]:
        local = iter(self.loader)
        if self._evaluation:
            for batch in local:
                yield batch, 1.0
            return
        held: Any = None  # the last batch: a stand-in once this part has run out
        # trained on before a resume (a stream drawn without end is not read again)
        for batch in itertools.islice(local, self._start if self.part.bounded else 0):
            held = batch
        while True:
            batch = next(local, None)
            mine = 0 if batch is None else batch_length(batch)
            counts = [mine] if self._count is None else self._count(mine)
            total = sum(counts)
            if total == 0:
                return
            if batch is not None:
                held = batch
                yield batch, mine * len(counts) / total
            elif held is None:
                raise UserError(
                    "a process's part of the webdataset pipeline holds no sample while "
                    "others train; use at least as many shards as processes"
                )
            else:
                yield _copied(held), 0.0


def _copied(batch: Any) -> Any:
    """``batch`` with new tensors (a stand-in carries its own loss weight, not the
    original batch's, which a loop may still hold)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, (list, tuple)):
        return type(batch)(_copied(item) for item in batch)
    if isinstance(batch, dict):
        return {key: _copied(value) for key, value in batch.items()}
    return batch
