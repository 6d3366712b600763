"""An ``IterableDataset`` split across processes and DataLoader workers: each item once an
epoch, and the same global batches on every layout.

The rule, for a loader with a ``batch_size`` (``B``, the global batch): number the items
0, 1, 2, ... in the order the data set yields them. Global batch ``g`` holds the items
``g*B`` to ``g*B + B - 1``, and process ``r`` of ``R`` takes its part of it as it does of a
map-style loader's global batch (near-equal contiguous parts, ``torch.tensor_split``'s
sizes). Worker ``w`` of ``W`` makes the batches ``g`` with ``(g - start) % W == w``, which
torch's DataLoader hands out in turn: batches come in the stream's order whatever the
number of workers, and one process and several train on the same global batches.

The uneven tail: the last global batch may hold fewer than ``B`` items. It is split the
same way on every layout; in training, a process with no item of it trains on a stand-in
(the batch's first item, with a loss weight of 0) as with map-style data, and evaluation
skips an empty part. ``drop_last=True`` drops it, on every layout alike. Nothing else is
dropped: every item once an epoch, and every process takes the same number of steps.

Every worker of every process reads the stream and keeps its items, except from a source
that reads only what it is asked for (:class:`RangeSource`: a length and ``read``, as
:class:`paratrain.data.shards.ShardStream`): it is asked for its spans, so what lies
before a resumed position, or only in the other processes' parts, is not read.

A data set that splits itself is left as it is (it would lose items split again): one that
says ``splits_itself = True``, or one whose ``__iter__`` calls ``get_worker_info()``
(torch's documented way); on several processes, one of those is refused for training, and
for evaluation unless it says ``splits_itself``. So is a loader without a ``batch_size``,
whose items are split one by one (:class:`SplitIterable`). Hugging Face ``datasets``'
iterable data sets are read whole in every worker (their rows, through ``iter``) and split
by the rule. A ``webdataset`` pipeline is split by its shards instead
(:mod:`paratrain.data.wds_pipeline`).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from paratrain.utils.errors import UserError

#: the attribute by which a data set says that it splits its stream itself
SPLITS_ITSELF = "splits_itself"

#: libraries whose iterable data sets split their stream across DataLoader workers
_WORKER_SPLITTING_LIBRARIES = frozenset({"webdataset"})
#: Hugging Face ``datasets``: read whole through their rows, then split by the rule
_HF_MODULE = "datasets"


def splits_itself(dataset: Any) -> bool:
    """Whether ``dataset`` says it splits its stream across workers and processes itself."""
    return getattr(dataset, SPLITS_ITSELF, False) is True


def splits_across_workers(dataset: Any) -> bool:
    """Whether ``dataset`` splits its stream across DataLoader workers itself: its library
    does, or its ``__iter__`` asks ``get_worker_info()`` (torch's documented way)."""
    if type(dataset).__module__.split(".")[0] in _WORKER_SPLITTING_LIBRARIES:
        return True
    if _is_hf(dataset):
        return False
    try:
        source = inspect.getsource(type(dataset).__iter__)
    except (OSError, TypeError):  # built in, or no source at hand
        return False
    return "get_worker_info" in source


def _is_hf(dataset: Any) -> bool:
    return type(dataset).__module__.split(".")[0] == _HF_MODULE and hasattr(dataset, "iter")


@runtime_checkable
class RangeSource(Protocol):
    """A stream of known length that reads only the items it is asked for."""

    def __len__(self) -> int: ...

    def read(self, spans: Sequence[tuple[int, int]], epoch: int) -> Iterator[Any]:
        """The items of ``spans`` (sorted, disjoint ``[start, end)`` places in ``epoch``'s
        order), in that order."""
        ...


@dataclass
class Part:
    """This process's part of one global batch, and its loss weight (0: a stand-in)."""

    batch: Any
    weight: float


@dataclass(frozen=True)
class _Plan:
    """Where a part lies in the epoch's order, and its loss weight."""

    start: int
    end: int
    weight: float


def local_span(size: int, part: int, parts: int) -> tuple[int, int]:
    """Where part ``part`` of ``parts`` lies in a global batch of ``size`` items."""
    base, extra = divmod(size, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


class GlobalBatches(IterableDataset[Part]):
    """This process's part of each global batch of ``dataset`` (the module's rule), made by
    whichever worker the batch falls to. ``epoch`` and ``start_batch`` are set before each
    iteration (DataLoader workers get a copy of it when an iteration starts)."""

    def __init__(
        self,
        dataset: Iterable[Any],
        batch_size: int,
        part: int,
        parts: int,
        *,
        drop_last: bool,
        evaluation: bool,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.part = part
        self.parts = parts
        self.drop_last = drop_last
        self.evaluation = evaluation
        self.epoch = 0
        self.start_batch = 0

    def sizes(self) -> list[int] | None:
        """The epoch's global batch sizes, where the data set tells its length."""
        if not isinstance(self.dataset, Sized):
            return None
        full, rest = divmod(len(self.dataset), self.batch_size)
        return [self.batch_size] * full + ([rest] if rest and not self.drop_last else [])

    def num_batches(self, start_batch: int) -> int | None:
        """How many parts this process makes from ``start_batch`` on (None: not known)."""
        sizes = self.sizes()
        if sizes is None:
            return None
        return sum(1 for _ in self._plans(sizes, start_batch))

    def _plan(self, first: int, size: int) -> _Plan | None:
        """This process's part of a global batch of ``size`` items from place ``first``."""
        start, end = local_span(size, self.part, self.parts)
        weight = 1.0 if self.parts == 1 else (end - start) * self.parts / size
        if end > start:
            return _Plan(first + start, first + end, weight)
        return None if self.evaluation else _Plan(first, first + 1, 0.0)

    def _plans(self, sizes: list[int], start_batch: int) -> Iterator[_Plan]:
        first = sum(sizes[:start_batch])
        for size in sizes[start_batch:]:
            plan = self._plan(first, size)
            if plan is not None:
                yield plan
            first += size

    def __iter__(self) -> Iterator[Part]:
        info = get_worker_info()  # None in the main process (num_workers=0)
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        sizes = self.sizes()
        if isinstance(self.dataset, RangeSource) and sizes is not None:
            plans = list(
                itertools.islice(self._plans(sizes, self.start_batch), worker, None, workers)
            )
            items = self.dataset.read([(p.start, p.end) for p in plans], self.epoch)
            for plan in plans:
                yield Part(list(itertools.islice(items, plan.end - plan.start)), plan.weight)
            return
        yield from self._from_stream(workers, worker)

    def _from_stream(self, workers: int, worker: int) -> Iterator[Part]:
        """The parts of a stream read from its start: this worker's batches kept."""
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        items = iter(_rows(self.dataset))
        skipped = self.start_batch * self.batch_size
        if len(list(itertools.islice(items, skipped))) < skipped:
            return
        for index in itertools.count():
            first = (self.start_batch + index) * self.batch_size
            if index % workers != worker:  # another worker's: counted, not kept
                if sum(1 for _ in itertools.islice(items, self.batch_size)) < self.batch_size:
                    return
                continue
            batch = list(itertools.islice(items, self.batch_size))
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                return
            plan = self._plan(first, len(batch))
            if plan is not None:
                yield Part(batch[plan.start - first : plan.end - first], plan.weight)
            if len(batch) < self.batch_size:
                return


def _rows(dataset: Iterable[Any]) -> Iterable[Any]:
    """The items of ``dataset``, all of them in any worker: a Hugging Face iterable data
    set gives a worker only its shards when iterated there, and all of them through
    ``iter`` (its rows as batches of one)."""
    if not _is_hf(dataset):
        return dataset
    batches: Iterable[dict[str, Any]] = dataset.iter(batch_size=1)  # type: ignore[attr-defined]
    return ({key: value[0] for key, value in batch.items()} for batch in batches)


class CollateParts:
    """A loader's collate function applied to each part's items (in the worker)."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, part: Part) -> Part:
        return Part(self.collate(part.batch), part.weight)


class SplitIterable(IterableDataset[Any]):
    """The items of ``dataset`` that belong to this worker of the part ``part`` of ``parts``
    (a loader without a ``batch_size``: worker ``w`` of ``W`` on part ``r`` of ``R`` keeps
    the items ``i`` with ``i % (W * R) == r * W + w``)."""

    def __init__(self, dataset: IterableDataset[Any], part: int, parts: int) -> None:
        self.dataset = dataset
        self.part = part
        self.parts = parts

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()  # None in the main process (num_workers=0)
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return itertools.islice(
            _rows(self.dataset), self.part * workers + worker, None, workers * self.parts
        )


def split_iterable_loader(
    loader: DataLoader[Any],
    part: int,
    parts: int,
    pin_memory: bool,
    *,
    batch_size: int | None = None,
    evaluation: bool = False,
) -> DataLoader[Any]:
    """``loader`` (of an ``IterableDataset``) with its data set split as the module says:
    by global batches of ``batch_size`` (the loader's own if None), or as it is where it
    splits itself."""
    dataset = loader.dataset
    if splits_itself(dataset):
        return loader
    if splits_across_workers(dataset):
        if parts == 1:
            return loader
        raise UserError(
            f"{type(dataset).__name__} splits its stream across DataLoader workers itself, "
            f"and {parts} processes would each read all of it: split it across processes "
            "too (by rank) and set `splits_itself = True` on it, or evaluate it on one process"
        )
    size = batch_size or loader.batch_size
    if size is None:
        if parts == 1 and loader.num_workers == 0:
            return loader
        split: IterableDataset[Any] = SplitIterable(dataset, part, parts)  # type: ignore[arg-type]
        return DataLoader(
            split,
            batch_size=None,
            generator=loader.generator,
            **worker_settings(loader, pin_memory),
        )
    assert isinstance(dataset, IterableDataset)
    batches = GlobalBatches(
        dataset, size, part, parts, drop_last=loader.drop_last, evaluation=evaluation
    )
    settings = worker_settings(loader, pin_memory)
    # Each iteration hands the workers a fresh copy, with its epoch and start.
    settings["persistent_workers"] = False
    settings["collate_fn"] = CollateParts(loader.collate_fn or default_collate)
    return DataLoader(batches, batch_size=None, generator=loader.generator, **settings)


def worker_settings(loader: DataLoader[Any], pin_memory: bool) -> dict[str, Any]:
    """What a rebuilt loader keeps of ``loader``: its workers, collation and memory."""
    return {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": pin_memory or loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "prefetch_factor": loader.prefetch_factor if loader.num_workers > 0 else None,
        "persistent_workers": loader.persistent_workers,
    }
