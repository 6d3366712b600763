"""Data loaders that give every layout the same global batches.

Every strategy cuts the data the same way: one permutation per epoch, cut into global
batches of the loader's ``batch_size``, each split into as many near-equal parts as there are
processes. Process ``r`` takes part ``r``. One process and four processes therefore see the
same global batches, which is what lets every layout compute the same model. The epoch is
advanced on every ``iter()``, so ``set_epoch`` cannot be forgotten.

Where the permutation comes from:

- ``seed=None`` (``Runtime()``'s default): from the random generators exactly as torch's
  ``DataLoader`` draws it. Each ``iter()`` draws the workers' base seed from the loader's
  generator (the global one unless the loader was given its own), and a shuffled epoch is the
  permutation ``RandomSampler`` would draw. A ported script therefore consumes its random
  stream as it did, and its dropout masks stay where they were. With several processes, rank
  0's permutation seed is broadcast (``agree``), so even an unseeded script's processes agree.
- an int ``seed`` (``Runtime(seed=N)``, ``paratrain train --seed``): epoch ``e`` is the
  permutation of a private generator seeded with ``seed + e``; nothing is drawn from the
  global generator, so a run resumed mid-epoch continues the same order and random stream.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator, Sized
from typing import Any, NamedTuple, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from paratrain.data.iterable_split import (
    GlobalBatches,
    local_span,
    split_iterable_loader,
    worker_settings,
)
from paratrain.data.placement import move_to_device
from paratrain.data.stateful import loader_class, shuffles, splittable
from paratrain.data.wds_pipeline import PipelinePart, is_pipeline
from paratrain.launching.heartbeat import beat
from paratrain.utils.errors import UserError

#: the attribute a training batch's tensors carry their :class:`BatchInfo` in
BATCH_INFO = "_paratrain_batch"


class BatchInfo(NamedTuple):
    """What the step needs to know of a training batch, carried by the batch itself (an
    attribute of its tensors), so that it holds when the batch is *used*, not when it was
    handed out: a loop may take batches ahead (prefetch, ``list(loader)``, ``zip``). A
    tuple: one is made for every batch, and a tuple is the cheapest immutable record."""

    #: this process's loss weight: a mean of the processes' losses is the global mean
    #: even when the last global batch does not split evenly
    loss_weight: float = 1.0
    #: the epoch's last batch: an unfinished group of accumulated micro-batches is applied
    ends_epoch: bool = False
    #: the loader that made it (its batches not used yet are forgotten when it restarts)
    source: int = 0
    #: a stand-in: this process has no sample of the global batch, so it trains on one of
    #: the others' with a loss weight of 0 (:class:`ShardedBatchSampler`); it counts no sample
    stand_in: bool = False


#: a batch that carries nothing (a tensor the loop made itself)
PLAIN_BATCH = BatchInfo()


class BatchSink(Protocol):
    """Who learns of each training batch handed out (the runtime's step state)."""

    #: micro-batches per optimizer step (more than 1: an epoch's last batch must be known)
    accumulate: int

    def handed_out(self, info: BatchInfo) -> None: ...

    def restarted(self, source: int) -> None: ...

    def epoch_done(self) -> None: ...


def tag_batch(batch: Any, info: BatchInfo) -> Any:
    """Give every tensor of ``batch`` (nested in tuples, lists and dicts) ``info``."""
    if isinstance(batch, torch.Tensor):
        setattr(batch, BATCH_INFO, info)
    elif isinstance(batch, (list, tuple)):
        for item in batch:  # the common (x, y) batch's tensors without a call each
            if isinstance(item, torch.Tensor):
                setattr(item, BATCH_INFO, info)
            else:
                tag_batch(item, info)
    elif isinstance(batch, dict):
        for item in batch.values():
            tag_batch(item, info)
    return batch


def batch_info(*values: Any) -> BatchInfo | None:
    """The :class:`BatchInfo` a training batch's tensor among ``values`` carries (looked for
    in nested tuples, lists and dicts, first found wins), or None."""
    for value in values:
        if isinstance(value, torch.Tensor):
            info = getattr(value, BATCH_INFO, None)
            if info is not None:
                return info
        elif isinstance(value, (list, tuple)):
            found = batch_info(*value)
            if found is not None:
                return found
        elif isinstance(value, dict):
            found = batch_info(*value.values())
            if found is not None:
                return found
    return None


class ShardedBatchSampler(Sampler[list[int]]):
    """Global batches in a seeded order; yields this process's part of each.

    ``evaluation=True`` never pads nor drops: every sample is seen exactly once across
    processes (a process whose part of the last batch is empty skips it). For training, a
    last global batch smaller than the number of processes is trained on too: a process with
    no sample of it gets a *stand-in*, the batch's first sample again, whose loss weight is 0
    (:class:`DeviceLoader`). Every process must take the step (DDP all-reduces the gradients
    in the backward), and a batch of one real sample is exact where an empty one is not: the
    mean of an empty loss is NaN, its gradient too, and NaN times 0 is still NaN, whereas a
    finite loss times 0 has gradients of exactly 0. The others' weights make the step that of
    the batch on one process.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int | None,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        evaluation: bool = False,
        generator: torch.Generator | None = None,
        agree: Callable[[int], int] | None = None,
    ) -> None:
        """``seed=None``: draw each epoch's order as ``RandomSampler(generator=generator)``
        does; ``agree`` then makes every process use rank 0's draw (a broadcast)."""
        if batch_size < world_size and not evaluation:
            raise UserError(
                f"batch size {batch_size} is smaller than the number of processes "
                f"({world_size}); use a batch size of at least {world_size}"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.evaluation = evaluation
        self.generator = generator
        self.agree = agree
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Choose the epoch's order; ``start_batch`` skips batches already trained on."""
        self.epoch = epoch
        self.start_batch = start_batch

    def order(self) -> torch.Tensor:
        """The epoch's order of sample indices (a permutation, or 0..n-1). Unseeded, each
        call draws from the random generators: call it once per epoch."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        if self.seed is not None:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.num_samples, generator=generator)
        if self.generator is not None:  # RandomSampler draws from the loader's own generator
            return torch.randperm(self.num_samples, generator=self.generator)
        # RandomSampler's draw: a seed from the global generator, then a private permutation
        drawn = int(torch.empty((), dtype=torch.int64).random_().item())
        if self.agree is not None:
            drawn = self.agree(drawn)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(drawn))

    def end_epoch(self) -> None:
        """After a whole epoch: RandomSampler then draws a last, empty permutation from a
        generator the loader was given; draw it too, so that generator stays in step."""
        if self.shuffle and self.seed is None and self.generator is not None:
            torch.randperm(self.num_samples, generator=self.generator)

    def global_batch_sizes(self) -> list[int]:
        full, rest = divmod(self.num_samples, self.batch_size)
        sizes = [self.batch_size] * full
        if rest and not self.drop_last:
            sizes.append(rest)
        return sizes

    def local_size(self, global_size: int) -> int:
        """How many samples of a global batch this process gets (tensor_split sizes)."""
        start, end = self.local_span(global_size)
        return end - start

    def local_span(self, global_size: int) -> tuple[int, int]:
        """Where this process's part starts and ends inside a global batch."""
        base, extra = divmod(global_size, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)

    def spans(self) -> list[tuple[int, int]]:
        """Where this process's part of each remaining batch lies in :meth:`order`; for
        training, an empty part is the batch's first sample, a stand-in (see the class)."""
        found: list[tuple[int, int]] = []
        parts: dict[int, tuple[int, int]] = {}  # a part's place, by batch size (two at most)
        position = 0
        for index, size in enumerate(self.global_batch_sizes()):
            if index >= self.start_batch:
                if size not in parts:
                    parts[size] = self.local_span(size)
                start, end = parts[size]
                if end > start:
                    found.append((position + start, position + end))
                elif not self.evaluation:
                    found.append((position, position + 1))
            position += size
        return found

    def __iter__(self) -> Iterator[list[int]]:
        order: list[int] = self.order().tolist()  # plain lists: slicing costs no tensor ops
        for start, end in self.spans():  # worked out at once: no call per batch
            yield order[start:end]
        self.end_epoch()

    def __len__(self) -> int:
        sizes = self.global_batch_sizes()[self.start_batch :]
        if not self.evaluation:  # training: every batch, a stand-in where a part is empty
            return len(sizes)
        return sum(1 for size in sizes if self.local_size(size) > 0)


class DeviceLoader:
    """Wraps a DataLoader: same global batches on every layout, delivered on the device."""

    #: how batches are made: "loader" (the DataLoader's samples and collate); subclasses
    #: that cut whole batches out of tensors say "batched" or "device"
    data_path = "loader"

    def __init__(
        self,
        loader: DataLoader[Any],
        device: torch.device,
        batch_sampler: ShardedBatchSampler | None,
        loss_weight_sink: BatchSink | None = None,
    ) -> None:
        self.loader = loader
        self.device = device
        self.batch_sampler = batch_sampler
        #: told of every training batch handed out (None for evaluation loaders)
        self._sink = loss_weight_sink
        self._next_epoch = 0
        self._epoch_set_by_user = False
        #: called when an iteration starts under ``torch.no_grad()`` (an evaluation loop)
        self.on_no_grad: Callable[[DeviceLoader], None] | None = None
        #: (epoch, global batches of it handed out) while training, for :meth:`state_dict`
        self._position: tuple[int, int] | None = None

    @property
    def evaluation(self) -> bool:
        """Whether it was set up to show every sample exactly once across processes."""
        return self.batch_sampler is None or self.batch_sampler.evaluation

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def epoch(self) -> int:
        return self.batch_sampler.epoch if self.batch_sampler else self._next_epoch - 1

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Pin the next iteration to ``epoch`` (resume); otherwise epochs advance by one."""
        self._next_epoch = epoch
        self._position = (epoch, start_batch)
        if self.batch_sampler is not None:
            self.batch_sampler.set_epoch(epoch, start_batch)
            self._epoch_set_by_user = True

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the data: the epoch and the global batches of it handed
        out (the same on every process), or a stateful loader's own position (torchdata's
        ``StatefulDataLoader``) with the epoch whose order it is in."""
        inner = getattr(self.loader, "state_dict", None)
        if inner is not None:
            return {"epoch": self.epoch, "loader": inner()}
        if not self._seeks():
            raise AttributeError(
                f"{type(self.loader).__name__} of a {type(self.dataset).__name__} keeps no "
                "position paratrain can return to: build the DataLoader with a batch_size "
                "(and shuffle=True or False), or use torchdata's StatefulDataLoader"
            )
        epoch, batch = self._position or (self._next_epoch, 0)
        return {"epoch": epoch, "batch": batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s position: its epoch's order, the batches not
        handed out yet."""
        if "loader" in state:
            self.set_epoch(int(state["epoch"]))
            self.loader.load_state_dict(state["loader"])  # type: ignore[attr-defined]
            return
        self.set_epoch(int(state["epoch"]), int(state["batch"]))

    def _seeks(self) -> bool:
        """Whether ``set_epoch(epoch, start_batch)`` can start an epoch mid-way."""
        return self.batch_sampler is not None

    def _loss_weights(self) -> list[float] | None:
        """Per-batch weights that make the mean of the processes' losses the global mean
        (0 for a stand-in: its process has no sample of the batch)."""
        sampler = self.batch_sampler
        if sampler is None or sampler.world_size == 1 or self._sink is None:
            return None
        sizes = sampler.global_batch_sizes()[sampler.start_batch :]
        return [sampler.local_size(s) * sampler.world_size / s for s in sizes]

    def _begin_epoch(self) -> None:
        """Choose the epoch an iteration shows: the one set, or the next."""
        if self.batch_sampler is not None:
            if not self._epoch_set_by_user:
                self.batch_sampler.set_epoch(self._next_epoch)
            self._next_epoch = self.batch_sampler.epoch + 1
        else:
            self._next_epoch += 1

    def _start_batch(self) -> int:
        """Where the epoch an iteration shows starts (batches already trained on)."""
        return 0 if self.batch_sampler is None else self.batch_sampler.start_batch

    def __iter__(self) -> Iterator[Any]:
        self._begin_epoch()
        self._epoch_set_by_user = False
        if self.on_no_grad is not None and not torch.is_grad_enabled():
            self.on_no_grad(self)
        sink = self._sink
        if sink is None:
            for batch, _ in self._weighted_batches():
                beat()  # progress, for the hang watchdog (evaluation has no backward)
                yield move_to_device(batch, self.device)
            return
        # Each batch carries its own loss weight and whether it ends the epoch: the step
        # reads them when the batch is used, whatever the loop took ahead of it.
        source = id(self)
        sink.restarted(source)
        epoch = self.epoch
        self._position = (epoch, self._start_batch())
        for (batch, weight), last in self._marking_last(sink.accumulate):
            info = BatchInfo(weight, last, source, weight == 0)
            sink.handed_out(info)
            self._position = (epoch, self._position[1] + 1)
            beat()
            yield tag_batch(move_to_device(batch, self.device), info)
        self._position = (epoch + 1, 0)
        sink.epoch_done()  # every process ends its epoch at the same batch

    def _batches(self) -> Iterator[Any]:
        """The epoch's batches, once the epoch is chosen (``__iter__`` puts them on the
        device: one pass over each batch's tensors, not two)."""
        return iter(self.loader)

    def _weighted_batches(self) -> Iterator[tuple[Any, float]]:
        """The epoch's batches, each with this process's loss weight (paired in C: no call
        of a generator of ours per batch)."""
        weights = self._loss_weights()
        weighted = itertools.repeat(1.0) if weights is None else weights
        return zip(self._batches(), weighted, strict=False)  # repeat() never ends

    def _known_length(self) -> int | None:
        """How many batches the epoch has left, where it is known before its end."""
        return None if isinstance(self.loader.dataset, IterableDataset) else len(self.loader)

    def _marking_last(self, accumulate: int) -> Iterator[tuple[tuple[Any, float], bool]]:
        """The epoch's batches and weights, each with whether it is the last. Where the
        loader has no length to tell (an ``IterableDataset``'s), its end is seen one batch
        ahead, and only where it matters (``accumulate`` > 1: a group of micro-batches
        unfinished at the end of the epoch is applied there), so that otherwise no batch is
        read before its turn. With a length, paired in C: no call of ours per batch."""
        length = self._known_length()
        if length is not None:
            # batch length-1 is the last (a loader with more batches than its length said:
            # the rest are not)
            before, after = itertools.repeat(False, length - 1), itertools.repeat(False)
            lasts = itertools.chain(before, (True,), after)
            return zip(self._weighted_batches(), lasts, strict=False)
        if accumulate == 1:
            return zip(self._weighted_batches(), itertools.repeat(False), strict=False)
        return self._marking_last_seen_ahead()

    def _marking_last_seen_ahead(self) -> Iterator[tuple[tuple[Any, float], bool]]:
        batches = self._weighted_batches()
        held = next(batches, None)
        for pair in batches:
            assert held is not None
            yield held, False
            held = pair
        if held is not None:
            yield held, True


def shard_loader(
    loader: DataLoader[Any],
    *,
    rank: int,
    world_size: int,
    seed: int | None,
    evaluation: bool,
    pin_memory: bool,
    batch_size: int | None = None,
    agree: Callable[[int], int] | None = None,
) -> tuple[DataLoader[Any], ShardedBatchSampler | None]:
    """Rebuild ``loader`` around a :class:`ShardedBatchSampler` (same settings otherwise).

    ``batch_size``: the global batch, when it is not the loader's own (paratrain.runtime.batching);
    ``seed`` and ``agree``: where a shuffled epoch's order comes from (see the module).
    """
    if is_pipeline(loader.dataset):
        return pipeline_loader(loader, rank, world_size, seed, pin_memory, batch_size), None
    if isinstance(loader.dataset, IterableDataset):
        split = split_iterable_loader(
            loader, rank, world_size, pin_memory, batch_size=batch_size, evaluation=evaluation
        )
        if world_size > 1 and not evaluation and not isinstance(split.dataset, GlobalBatches):
            raise UserError(
                f"training on {world_size} processes needs the loader to split the "
                f"{type(loader.dataset).__name__} itself: build the DataLoader with a "
                "batch_size and a data set that does not split itself (see 'Data at scale' "
                "in the docs), or use a map-style dataset"
            )
        return split, None
    if loader.batch_size is None:
        if world_size > 1:
            raise UserError(
                "several processes need a loader with batch_size; a custom batch_sampler "
                "cannot be split across processes"
            )
        return loader, None
    if not splittable(loader.sampler):
        if world_size > 1:
            raise UserError(
                f"the loader's sampler {type(loader.sampler).__name__} cannot be split across "
                "processes; build the DataLoader with shuffle=True or shuffle=False instead"
            )
        return loader, None
    if not isinstance(loader.dataset, Sized):
        return loader, None
    random = loader.sampler if shuffles(loader.sampler) else None
    shuffle = random is not None
    if random is not None and getattr(random, "replacement", False):
        warnings.warn("sampling with replacement is replaced by a shuffle", stacklevel=3)
    sampler = ShardedBatchSampler(
        len(loader.dataset),
        batch_size or loader.batch_size,
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        drop_last=loader.drop_last,
        evaluation=evaluation,
        generator=None if random is None else getattr(random, "generator", None),
        agree=agree,
    )
    if seed is None:
        # torch's own draws: the base seed from the loader's generator, or the global one
        generator = loader.generator
    else:
        # A private generator: starting an epoch then draws nothing from the global one,
        # so a run resumed mid-epoch continues the same random stream.
        generator = loader.generator or torch.Generator().manual_seed(seed)
    rebuilt = loader_class(loader)(
        loader.dataset,
        batch_sampler=sampler,
        generator=generator,
        **worker_settings(loader, pin_memory),
    )
    return rebuilt, sampler


def pipeline_loader(
    loader: DataLoader[Any],
    part: int,
    parts: int,
    seed: int | None,
    pin_memory: bool,
    batch_size: int | None = None,
) -> DataLoader[Any]:
    """``loader`` of a webdataset pipeline, rebuilt around this process's shards
    (:class:`PipelinePart`); a ``batch_size`` is the global batch, split as a map-style
    loader's is (this process batches its part of it)."""
    size = batch_size or loader.batch_size
    if size is not None:
        start, end = local_span(size, part, parts)
        if end == start:
            raise UserError(
                f"batch size {size} is smaller than the number of processes ({parts}); "
                f"use a batch size of at least {parts}"
            )
        size = end - start
    settings = worker_settings(loader, pin_memory)
    settings["persistent_workers"] = False  # each epoch's workers get its epoch and seeds
    return DataLoader(
        PipelinePart(loader.dataset, part, parts, seed),
        batch_size=size,
        drop_last=loader.drop_last,
        generator=loader.generator,
        **settings,
    )
