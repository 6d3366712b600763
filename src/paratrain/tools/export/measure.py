"""The figures of an export, before and after: file size, test metrics, latency per batch."""

from __future__ import annotations

import io
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass
class Figures:
    name: str
    file_bytes: int
    test_loss: float
    test_accuracy: float | None
    #: median seconds of one forward pass over one batch, after warm-up
    latency_seconds: float
    latency_min: float
    latency_max: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def saved_bytes(model: nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())``: the same container for both models."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def evaluate(
    model: nn.Module,
    test_set: Dataset[Any],
    loss_fn: nn.Module,
    classify: bool,
    batch_size: int,
    device: torch.device,
) -> tuple[float, float | None]:
    """Mean loss and accuracy over the whole test set."""
    loss_sum, correct, count = 0.0, 0, 0
    dtype = _dtype(model)
    with torch.inference_mode():
        for x, y in DataLoader(test_set, batch_size=batch_size):
            x, y = x.to(device, dtype), y.to(device)
            output = model(x).float()
            loss_sum += loss_fn(output, y).item() * len(y)
            if classify:
                correct += int((output.argmax(dim=1) == y).sum())
            count += len(y)
    count = max(count, 1)
    return loss_sum / count, (correct / count if classify else None)


def latency(
    model: nn.Module, batch: torch.Tensor, device: torch.device, repeats: int, warmup: int = 3
) -> tuple[float, float, float]:
    """(median, min, max) seconds of a forward pass on ``batch``; devices synchronized."""
    x = batch.to(device, _dtype(model))
    times = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)
