"""Device synchronization and peak memory, per device and per process."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from paratrain.distributed.dtensors import local_bytes
from paratrain.utils.peak_memory import peak_rss_bytes


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until every queued kernel on ``devices`` has finished (a fair timer's fence)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state this process holds: its shards
    under fsdp (``DTensor.to_local()``), whole tensors elsewhere. Call it after a step,
    before ``zero_grad``, so the gradients and optimizer state exist."""
    params = list(model.parameters())
    total = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in params)
    for state in optimizer.state.values():
        total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def memory_snapshot(devices: Iterable[torch.device], rank: int) -> dict[str, Any]:
    """Peak memory of this process (host) and of each accelerator it drives."""
    entries: list[dict[str, Any]] = []
    for device in devices:
        if device.type == "cuda":
            entries.append(
                {
                    "device": str(device),
                    "rank": rank,
                    "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
                    "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
                }
            )
        elif device.type == "mps":
            # MPS keeps no peak; what the driver holds at the end is the closest figure.
            entries.append(
                {
                    "device": str(device),
                    "rank": rank,
                    "peak_allocated_bytes": int(torch.mps.driver_allocated_memory()),
                    "peak_reserved_bytes": None,
                }
            )
    return {"host": {"rank": rank, "peak_rss_bytes": peak_rss_bytes()}, "devices": entries}


def memory_bars(memory: dict[str, Any]) -> list[tuple[str, int]]:
    """What to show per device: accelerator peaks when there are any, else each process's
    peak resident memory (CPU layouts)."""
    devices = memory.get("devices") or []
    if devices:
        return [
            (str(d["device"]), int(d["peak_allocated_bytes"]))
            for d in devices
            if d.get("peak_allocated_bytes") is not None
        ]
    hosts = memory.get("host") or []
    return [
        (f"rank{h['rank']} RSS", int(h["peak_rss_bytes"]))
        for h in hosts
        if h.get("peak_rss_bytes") is not None
    ]
