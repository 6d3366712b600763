"""How a loader's batches are made: ``rt.setup_loader(loader, data_path=...)`` and
``paratrain train --data-path``. Every path gives the same batches, bit for bit.

- ``loader``: the DataLoader's own ``__getitem__`` per sample, then its collate. Any data set,
  collate_fn, workers.
- ``batched``: whole batches cut out of the data set's tensors by index
  (:mod:`paratrain.data.tensor_data`), in host memory. Needs a data set of tensors, the default
  collate, no workers, and a loader built with ``shuffle=True`` or ``False``.
- ``device``: as ``batched``, but the tensors are copied to the accelerator (CUDA or MPS)
  once and batches are cut there. Needs the data to fit the budget: ``device_budget_gib``,
  by default a quarter of the device's free memory when the loader is set up.
- ``auto`` (default): ``device`` where it applies, else ``batched``, else ``loader``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from paratrain.data.batched_loader import TensorBatchLoader
from paratrain.data.iterable_split import GlobalBatches
from paratrain.data.loaders import BatchSink, DeviceLoader, ShardedBatchSampler, shard_loader
from paratrain.data.pipeline_loader import CountSamples, PipelineLoader
from paratrain.data.stateful import keeps_position
from paratrain.data.stream_loader import StreamLoader
from paratrain.data.tensor_data import TensorRows, tensor_rows
from paratrain.data.wds_pipeline import PipelinePart
from paratrain.utils.errors import UserError

DATA_PATHS = ("auto", "loader", "batched", "device")
#: the share of a device's free memory the device path may fill, unless told a budget
DEVICE_SHARE = 0.25
ACCELERATORS = ("cuda", "mps")
_GIB = 2**30
_NO_ACCELERATOR = 'it needs a CUDA or MPS device, and this process trains on {}; use "batched"'


def check_data_path(
    data_path: str, device_budget_gib: float | None = None, device: torch.device | None = None
) -> None:
    """Refuse an unknown path, a budget that is not positive, and ``device`` off accelerators."""
    if data_path not in DATA_PATHS:
        raise UserError(
            f"unknown data path {data_path!r}; valid data paths: {', '.join(DATA_PATHS)}"
        )
    if device_budget_gib is not None and not 0 < device_budget_gib < math.inf:
        raise UserError(f"the device budget must be a positive GiB figure, got {device_budget_gib}")
    if data_path == "device" and device is not None and device.type not in ACCELERATORS:
        raise UserError(f'data path "device" does not apply: {_NO_ACCELERATOR.format(device)}')


def device_budget_bytes(device: torch.device, device_budget_gib: float | None) -> int | None:
    """How many bytes of data the device path may copy to ``device`` (None: unknown)."""
    if device_budget_gib is not None:
        return int(device_budget_gib * _GIB)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEVICE_SHARE)
    recommended = getattr(torch.mps, "recommended_max_memory", None)
    if device.type == "mps" and recommended is not None:
        return int((recommended() - torch.mps.driver_allocated_memory()) * DEVICE_SHARE)
    return None


def setup_data_path(
    loader: DataLoader[Any],
    *,
    device: torch.device,
    rank: int,
    world_size: int,
    seed: int | None,
    evaluation: bool,
    sink: BatchSink | None,
    data_path: str = "auto",
    device_budget_gib: float | None = None,
    batch_size: int | None = None,
    agree: Callable[[int], int] | None = None,
    count: CountSamples | None = None,
) -> DeviceLoader:
    """Shard ``loader`` across processes and serve its batches the way ``data_path`` says;
    ``batch_size`` is the global batch when it is not the loader's own; ``seed`` and
    ``agree``: where a shuffled epoch's order comes from (:mod:`paratrain.data.loaders`);
    ``count``: every process's samples in a step, for a webdataset pipeline's parts."""
    check_data_path(data_path, device_budget_gib)
    rebuilt, sampler = shard_loader(
        loader,
        rank=rank,
        world_size=world_size,
        seed=seed,
        evaluation=evaluation,
        pin_memory=device.type == "cuda",
        batch_size=batch_size,
        agree=agree,
    )
    if isinstance(rebuilt.dataset, (GlobalBatches, PipelinePart)):
        if data_path in ("batched", "device"):
            raise UserError(
                f'data path "{data_path}" does not apply: the data set is iterable (no '
                'tensors to cut batches out of); use "loader" or "auto"'
            )
        if isinstance(rebuilt.dataset, PipelinePart):
            return PipelineLoader(rebuilt, device, sink, count, evaluation)
        return StreamLoader(rebuilt, device, sink)
    if data_path == "loader":
        return DeviceLoader(rebuilt, device, sampler, sink)
    rows = _rows(loader, sampler)
    if isinstance(rows, str):
        if data_path == "auto":
            return DeviceLoader(rebuilt, device, sampler, sink)
        raise UserError(f'data path "{data_path}" does not apply: {rows}; use "loader" or "auto"')
    assert sampler is not None  # _rows said why otherwise
    resident = data_path == "device"
    if data_path != "batched":
        unfit = _device_unfit(rows, device, device_budget_gib)
        if unfit is not None and resident:
            raise UserError(f'data path "device" does not apply: {unfit}')
        resident = unfit is None
    return TensorBatchLoader(
        rebuilt, device, sampler, rows, resident=resident, loss_weight_sink=sink
    )


def _rows(loader: DataLoader[Any], sampler: ShardedBatchSampler | None) -> TensorRows | str:
    """The loader's tensors, or why its batches cannot be cut out of them."""
    if sampler is None:
        return (
            "the loader has its own sampler or batch_sampler, or no batch_size; build it "
            "with batch_size and shuffle=True or False"
        )
    if keeps_position(loader):
        return f"{type(loader).__name__} keeps its own position (its state_dict)"
    if loader.num_workers > 0:
        return f"the loader has num_workers={loader.num_workers} (tensors need none)"
    if loader.collate_fn is not default_collate:
        return "the loader has its own collate_fn"
    return tensor_rows(loader.dataset)


def _device_unfit(
    rows: TensorRows, device: torch.device, device_budget_gib: float | None
) -> str | None:
    """Why the tensors should not be copied to ``device``, or None when they fit."""
    if device.type not in ACCELERATORS:
        return _NO_ACCELERATOR.format(device)
    budget = device_budget_bytes(device, device_budget_gib)
    if budget is None:
        return f"{device} does not say how much memory is free; pass --device-budget-gib"
    if rows.nbytes > budget:
        which = "the budget" if device_budget_gib is not None else "a quarter of its free memory"
        return (
            f"the data takes {rows.nbytes / _GIB:.2f} GiB, more than {which} on {device} "
            f"({budget / _GIB:.2f} GiB); raise --device-budget-gib (device_budget_gib) or "
            'use "batched"'
        )
    return None
