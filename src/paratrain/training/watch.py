"""What a training run shows of itself: throughput, MFU and peak memory per device, for
metrics.jsonl, the progress line and TensorBoard (see :mod:`paratrain.utils.flops`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.checkpoints.weights import unwrap_model
from paratrain.runtime.facade import Runtime
from paratrain.utils.flops import Peak, peak_of, training_flops
from paratrain.utils.peak_memory import peak_memory_bytes


class RunWatch:
    """Counts the model's FLOPs once (main process), turns throughput into MFU, and
    gathers every process's peak memory per device."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.flops_per_sample: float | None = None
        self.peak: Peak | None = None
        self._counted = False

    def count(
        self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any
    ) -> None:
        """Once, on the main process, with the first batch: FLOPs per sample and the peak
        of all the run's devices. A pipeline stage holds a part of the model: not counted."""
        if self._counted or not self.rt.is_main:
            return
        self._counted = True
        if self.rt.strategy.trains_in_pipeline:
            return
        flops = training_flops(unwrap_model(model), loss_fn, inputs, targets)
        samples = len(targets) if hasattr(targets, "__len__") else 0
        if flops is None or samples == 0:
            return
        # a process's batch is its share of the global batch: per sample it is the same
        self.flops_per_sample = flops / samples
        self.peak = peak_of(self.rt.device, self.rt.precision.name)

    @property
    def local_devices(self) -> list[torch.device]:
        """The devices this process drives (several for DataParallel, one for a group)."""
        return list(self.rt.strategy.devices) if self.rt.world_size == 1 else [self.rt.device]

    @property
    def devices(self) -> int:
        return self.rt.world_size * len(self.local_devices)

    def mfu(self, samples_per_second: float) -> float | None:
        """Achieved FLOP/s over the peak of every device of the run."""
        if self.flops_per_sample is None or self.peak is None:
            return None
        return (
            samples_per_second * self.flops_per_sample / (self.peak.flops_per_second * self.devices)
        )

    def peak_memory(self) -> dict[str, int | None]:
        """Bytes at the peak per device: ``{"cuda:0": ...}`` for one process,
        ``{"rank0": ..., "rank1": ...}`` for several. Every process calls it (a collective
        where there are several); the CPU's figure is the process's peak resident memory."""
        local = self.local_devices
        peaks = [peak_memory_bytes(device) for device in local]
        values = torch.tensor([-1 if p is None else p for p in peaks], dtype=torch.float64)
        if self.rt.world_size > 1:
            gathered = self.rt.all_gather(values.to(self.rt.device), over="processes")
        else:
            gathered = [values]
        names = [str(d) for d in local]
        if self.rt.world_size > 1:  # every process has devices of its own
            names = [f"rank{{}}:{i}" if len(local) > 1 else "rank{}" for i in range(len(local))]
        return {
            name.format(rank): None if value < 0 else int(value)
            for rank, row in enumerate(gathered)
            for name, value in zip(names, row.cpu().tolist(), strict=True)
        }

    def record(self, samples_per_second: float) -> dict[str, Any]:
        """The fields the loop adds to an epoch's training record."""
        mfu = self.mfu(samples_per_second)
        return {
            "samples_per_second": samples_per_second,
            "flops_per_sample": self.flops_per_sample,
            "mfu": mfu,
            "mfu_peak": None if self.peak is None else self.peak.to_dict(),
        }
