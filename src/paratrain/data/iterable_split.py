"""An ``IterableDataset`` split across DataLoader workers and processes: each item once.

torch gives every DataLoader worker a copy of an iterable data set, and each copy yields the
whole stream unless the data set splits itself; every process of a run would do the same.
``rt.setup_loader`` therefore splits it by the items' places in the stream: number them
0, 1, 2, ... in the order the data set yields them; worker ``w`` of ``W`` on the part ``r``
of ``R`` (the process's part of the data) keeps the items ``i`` with
``i % (W * R) == r * W + w``. Every worker reads the whole stream and keeps its share.

A data set that already splits itself is not split again (that would drop items silently):

* one whose class (or instance) sets ``splits_itself = True`` splits across workers and
  processes itself, and is handed to the workers as it is;
* one that splits across workers itself, which ``torch.utils.data``'s documentation shows
  (its ``__iter__`` calls ``get_worker_info()``), and those of libraries that do it for
  their users (Hugging Face ``datasets``, ``webdataset``): on one process it is handed on as
  it is; on several, how it splits across processes cannot be known, so it is refused in
  one line until it says ``splits_itself = True``.

With one worker and one process the order is the stream's. With several workers each
batch holds one worker's items (torch's own way with iterable data sets): the samples of an
epoch do not depend on ``num_workers``, its batches do.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from paratrain.utils.errors import UserError

#: the attribute by which a data set says that it splits its stream itself
SPLITS_ITSELF = "splits_itself"


#: libraries whose iterable data sets split their stream across DataLoader workers
_WORKER_SPLITTING_LIBRARIES = frozenset({"datasets", "webdataset"})


def splits_itself(dataset: Any) -> bool:
    """Whether ``dataset`` says it splits its stream across workers and processes itself."""
    return getattr(dataset, SPLITS_ITSELF, False) is True


def splits_across_workers(dataset: Any) -> bool:
    """Whether ``dataset`` splits its stream across DataLoader workers itself: its library
    does, or its ``__iter__`` asks ``get_worker_info()`` (torch's documented way)."""
    if type(dataset).__module__.split(".")[0] in _WORKER_SPLITTING_LIBRARIES:
        return True
    try:
        source = inspect.getsource(type(dataset).__iter__)
    except (OSError, TypeError):  # built in, or no source at hand
        return False
    return "get_worker_info" in source


class SplitIterable(IterableDataset[Any]):
    """The items of ``dataset`` that belong to this worker of the part ``part`` of ``parts``."""

    def __init__(self, dataset: IterableDataset[Any], part: int, parts: int) -> None:
        self.dataset = dataset
        self.part = part
        self.parts = parts

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()  # None in the main process (num_workers=0)
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return itertools.islice(
            self.dataset, self.part * workers + worker, None, workers * self.parts
        )


def split_iterable_loader(
    loader: DataLoader[Any], part: int, parts: int, pin_memory: bool
) -> DataLoader[Any]:
    """``loader`` (of an ``IterableDataset``) with its data set split as the module says; as
    it is where nothing is to be split (one process, no workers) or the data set splits
    itself."""
    dataset = loader.dataset
    if splits_itself(dataset) or (parts == 1 and loader.num_workers == 0):
        return loader
    if splits_across_workers(dataset):
        if parts == 1:
            return loader
        raise UserError(
            f"{type(dataset).__name__} splits its stream across DataLoader workers itself, "
            f"and {parts} processes would each read all of it: split it across processes "
            "too (by rank) and set `splits_itself = True` on it, or evaluate it on one process"
        )
    assert isinstance(dataset, IterableDataset)
    return DataLoader(
        SplitIterable(dataset, part, parts),
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        generator=loader.generator,
        **worker_settings(loader, pin_memory),
    )


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
