"""A user's own ``webdataset`` pipeline (``wds.WebDataset(urls).shuffle(N).decode(...)``,
``wds.DataPipeline(wds.SimpleShardList(urls), ...)``), split across processes and DataLoader
workers by its shards.

The rule: shard ``i`` of the pipeline's list goes to process ``i % R`` (of ``R``), and the
shards of a process go to its ``W`` workers in turn (the ``j``-th to worker ``j % W``):
webdataset's ``split_by_node`` then ``split_by_worker``, with the process's place in the
data (not its global rank, which differs where a pipeline's stages share a batch). The
pipeline's own node and worker splitters are replaced by this one, so the same pipeline
runs unchanged on one process and on several. When the shards do not split evenly, some
processes and workers read more shards (and samples) than others: every sample is still
read once an epoch, and :class:`~paratrain.data.pipeline_loader.PipelineLoader` keeps the
processes stepping together until the last one runs out.

A shuffle buffer (``.shuffle(N)``, ``shardshuffle=N``) cannot be saved: a resumed epoch
reads its shards again from their start and passes over the batches already trained on.
That is exact where the buffers draw the same order again, so with a run seed
(``Runtime(seed=N)``) each buffer is seeded from the seed, the epoch, the process, the
worker and its place in the pipeline (a new order each epoch, the same on a resume; a
``detshuffle`` is also told the epoch, which it otherwise counts itself); with
no run seed, webdataset draws from the clock and a resumed epoch's order differs.
A ``ResampledShards`` source (``resampled=True``) draws shards at random without end: it is
not split, and its epochs have no end (see "an unbounded stream" in the docs).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from paratrain.utils.errors import UserError

_LIBRARY = "webdataset"
#: webdataset's splitters, replaced by :func:`_this_part` (by name: no import needed)
_SPLITTERS = frozenset({"split_by_node", "single_node_only", "split_by_worker"})


def is_pipeline(dataset: Any) -> bool:
    """Whether ``dataset`` is a webdataset pipeline (a ``DataPipeline``: stages in a list)."""
    module = type(dataset).__module__.split(".")[0]
    return module == _LIBRARY and isinstance(getattr(dataset, "pipeline", None), list)


def is_web_loader(loader: Any) -> bool:
    """Whether ``loader`` is a ``wds.WebLoader`` (a pipeline whose source is a DataLoader)."""
    if not is_pipeline(loader):
        return False
    stages: list[Any] = loader.pipeline
    return bool(stages) and _is_data_loader(stages[0])


def _is_data_loader(value: Any) -> bool:
    return isinstance(value, DataLoader)


def unwrap_web_loader(loader: Any) -> Any:
    """The DataLoader of a ``wds.WebLoader`` with no stages after it (the loader itself
    otherwise): its data set is then split as any pipeline is."""
    if not is_web_loader(loader):
        return loader
    if len(loader.pipeline) > 1:
        raise UserError(
            "a wds.WebLoader with stages after its DataLoader (.unbatched(), .shuffle(), "
            ".batched(), ...) cannot be split across processes by its shards; put those "
            "stages in the WebDataset pipeline and give rt.setup_loader the WebLoader alone"
        )
    return loader.pipeline[0]


def _name(stage: Any) -> str:
    return str(getattr(stage, "__name__", ""))


def _is_resampled(stage: Any) -> bool:
    return type(stage).__name__ in ("ResampledShards", "ResampledShardList")


def _shuffles(stage: Any) -> bool:
    """A webdataset shuffle buffer (``filters.shuffle``: a curried ``_shuffle``)."""
    return _name(getattr(stage, "f", None)) == "_shuffle" and hasattr(stage, "kw")


def shard_count(pipeline: Any) -> int | None:
    """How many shards the pipeline's source lists (None: it draws them without end)."""
    source = pipeline.pipeline[0] if pipeline.pipeline else None
    urls = getattr(source, "urls", None)
    if _is_resampled(source) or urls is None:
        return None
    return len(urls)


class PipelinePart(IterableDataset[Any]):
    """This process's and worker's part of a webdataset pipeline (see the module), one
    epoch at a time: ``epoch`` is set before each iteration (DataLoader workers get a copy
    when an iteration starts)."""

    def __init__(self, pipeline: Any, part: int, parts: int, seed: int | None) -> None:
        if not pipeline.pipeline or not hasattr(pipeline.pipeline[0], "urls"):
            first = type(pipeline.pipeline[0]).__name__ if pipeline.pipeline else "nothing"
            raise UserError(
                f"the webdataset pipeline starts with {first}, "
                "not a list of shards; build it as wds.WebDataset(urls) or "
                "wds.DataPipeline(wds.SimpleShardList(urls), ...)"
            )
        self.pipeline = pipeline
        self.part = part
        self.parts = parts
        self.seed = seed
        self.epoch = 0
        self.shards = shard_count(pipeline)

    @property
    def bounded(self) -> bool:
        """Whether an epoch ends (a list of shards, not shards drawn without end)."""
        return self.shards is not None

    def shards_of(self, worker: int, workers: int) -> int:
        """How many shards worker ``worker`` of ``workers`` of this process reads."""
        assert self.shards is not None
        return len(range(self.part, self.shards, self.parts)[worker::workers])

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()  # None in the main process (num_workers=0)
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        if self.bounded and self.shards_of(worker, workers) == 0:
            return iter(())  # webdataset's empty check would fail a worker with no shard
        clone = copy.copy(self.pipeline)
        clone.pipeline = list(self._stages(worker, workers))
        return iter(clone)

    def _stages(self, worker: int, workers: int) -> Iterator[Any]:
        stages = self.pipeline.pipeline
        yield stages[0]
        if self.bounded:
            yield _Split(self.part, self.parts, worker, workers)
        for place, stage in enumerate(stages[1:], start=1):
            if _name(stage) in _SPLITTERS:
                continue
            yield self._seeded(stage, place, worker)

    def _seeded(self, stage: Any, place: int, worker: int) -> Any:
        """``stage``, a shuffle of it drawing this epoch's order from the run's seed."""
        seed = hash((self.seed, self.epoch, self.part, worker, place)) & 0x7FFFFFFF
        if _shuffles(stage) and self.seed is not None:
            return type(stage)(stage.f, *stage.args, **{**stage.kw, "seed": seed, "rng": None})
        if type(stage).__name__ == "detshuffle":  # it counts its epochs: told this one
            stage = copy.copy(stage)
            stage.epoch = self.epoch - 1  # its run() adds 1
            stage.seed = stage.seed if self.seed is None else seed
        return stage


class _Split:
    """Shard ``i`` to process ``i % parts``, then to its workers in turn (see the module)."""

    def __init__(self, part: int, parts: int, worker: int, workers: int) -> None:
        self.part, self.parts, self.worker, self.workers = part, parts, worker, workers

    def __call__(self, shards: Iterable[Any]) -> Iterator[Any]:
        mine = itertools.islice(shards, self.part, None, self.parts)
        return itertools.islice(mine, self.worker, None, self.workers)
