"""`paratrain bench crossover` (seed 003): from which matrix size does the GPU beat the CPU?

For small work the CPU wins, because moving the data costs more than computing on it. The
GPU time here includes the copies there and back, and is synchronized; the GPU's time for
the multiplication alone is shown beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from paratrain.tools.bench.stats import Spread

if TYPE_CHECKING:  # `paratrain bench crossover --help` shows DEFAULT_SIZES without torch
    import torch

DEFAULT_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class CrossoverRow:
    size: int
    cpu: Spread
    gpu_with_transfers: Spread
    gpu_compute: Spread

    def to_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "cpu_seconds": self.cpu.to_dict(),
            "gpu_with_transfers_seconds": self.gpu_with_transfers.to_dict(),
            "gpu_compute_seconds": self.gpu_compute.to_dict(),
        }


def crossover_size(
    sizes: Sequence[int], cpu_seconds: Sequence[float], gpu_seconds: Sequence[float]
) -> int | None:
    """The smallest size from which the GPU is faster at that size and every larger one
    measured; None if it never wins (or loses again at the largest size)."""
    found: int | None = None
    for size, cpu, gpu in sorted(zip(sizes, cpu_seconds, gpu_seconds, strict=True)):
        if gpu >= cpu:
            found = None
        elif found is None:
            found = size
    return found


def _matmul_there(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy both matrices to ``device``, multiply there, bring the product back."""
    return (a.to(device) @ b.to(device)).cpu()


def measure_crossover(
    device: torch.device, sizes: Sequence[int], repeats: int
) -> list[CrossoverRow]:
    """Time ``a @ b`` for ``n`` x ``n`` float32 matrices on the CPU and on ``device``."""
    import torch

    from paratrain.tools.bench.timing import timed

    cpu = torch.device("cpu")
    rows = []
    generator = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=generator)
        b = torch.randn(n, n, generator=generator)
        a_dev, b_dev = a.to(device), b.to(device)
        rows.append(
            CrossoverRow(
                size=n,
                cpu=timed(partial(torch.matmul, a, b), [cpu], repeats),
                gpu_with_transfers=timed(partial(_matmul_there, a, b, device), [device], repeats),
                gpu_compute=timed(partial(torch.matmul, a_dev, b_dev), [device], repeats),
            )
        )
        del a_dev, b_dev
    return rows
