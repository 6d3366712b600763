"""`paratrain bench placement` (seed 002): where to create a tensor that the GPU will use.

Creating on the CPU then copying pays for a host-to-device transfer that creating on the
device avoids; pinned (page-locked) host memory copies faster than pageable memory. Every
figure is synchronized: the seed's 0.00018 s for ``torch.rand(..., device='cuda')`` was the
time to *launch* the kernel, which is shown here too, labelled as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paratrain.tools.bench.stats import Spread
from paratrain.tools.bench.timing import timed


@dataclass(frozen=True)
class PlacementRow:
    name: str
    seconds: Spread | None
    bytes_moved: int | None = None
    note: str = ""

    @property
    def gb_per_second(self) -> float | None:
        if self.seconds is None or not self.bytes_moved or self.seconds.median <= 0:
            return None
        return self.bytes_moved / self.seconds.median / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seconds": None if self.seconds is None else self.seconds.to_dict(),
            "bytes_moved": self.bytes_moved,
            "gb_per_second": self.gb_per_second,
            "note": self.note,
        }


def measure_placement(device: torch.device, size: int, repeats: int) -> list[PlacementRow]:
    """Time the ways of getting a ``size`` x ``size`` float32 tensor onto ``device``."""
    devices = [device]
    nbytes = size * size * 4
    rows = [
        PlacementRow(
            "create on the CPU, then copy (torch.rand(n, n).to(device))",
            timed(lambda: torch.rand(size, size).to(device), devices, repeats),
            nbytes,
            "creation on the CPU included",
        ),
        PlacementRow(
            "create on the device (torch.rand(n, n, device=device))",
            timed(lambda: torch.rand(size, size, device=device), devices, repeats),
        ),
        PlacementRow(
            "create on the device, unsynchronized timer",
            timed(lambda: torch.rand(size, size, device=device), devices, repeats, sync=False),
            note="kernel launch only: not the real cost",
        ),
    ]
    host = torch.rand(size, size)
    rows.append(
        PlacementRow(
            "copy pageable host memory",
            timed(lambda: host.to(device), devices, repeats),
            nbytes,
        )
    )
    if device.type == "cuda":
        pinned = host.pin_memory()
        rows.append(
            PlacementRow(
                "copy pinned host memory (non_blocking)",
                timed(lambda: pinned.to(device, non_blocking=True), devices, repeats),
                nbytes,
            )
        )
    else:
        rows.append(PlacementRow("copy pinned host memory", None, note="pinned memory is for CUDA"))
    return rows
