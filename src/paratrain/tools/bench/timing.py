"""Fair timers for the micro-benchmarks: warm up, synchronize around every call, repeat."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from paratrain.devices.machine import cuda_count, mps_available
from paratrain.tools.bench.memory import synchronize
from paratrain.tools.bench.stats import Spread, spread
from paratrain.utils.errors import UserError

NO_GPU = "this machine has no GPU (CUDA or MPS), so there is nothing to compare the CPU with"


def pick_gpu(spec: str | None) -> torch.device | None:
    """The GPU to measure: ``spec`` if given, else cuda:0, else mps; None without one."""
    if spec is None:
        if cuda_count() > 0:
            return torch.device("cuda", 0)
        return torch.device("mps") if mps_available() else None
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(f"--devices {spec!r} is not a device; use e.g. cuda:0 or mps") from None
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", 0)
        if device.index >= cuda_count():
            raise UserError(f"--devices {device}: this machine has {cuda_count()} CUDA device(s)")
    elif device.type == "mps":
        if not mps_available():
            raise UserError("--devices mps: this machine has no Apple MPS device")
    else:
        raise UserError(f"--devices {spec}: choose a GPU (cuda:N or mps) to compare the CPU with")
    return device


def timed(
    fn: Callable[[], Any],
    devices: list[torch.device],
    repeats: int,
    warmup: int = 1,
    sync: bool = True,
) -> Spread:
    """Seconds per call of ``fn``. With ``sync=False`` only the launch is timed: the
    seed's 0.00018 s figure, which is what an unsynchronized timer sees on a GPU."""
    for _ in range(warmup):
        fn()
    synchronize(devices)
    seconds = []
    for _ in range(repeats):
        synchronize(devices)
        start = time.perf_counter()
        result = fn()
        if sync:
            synchronize(devices)
        seconds.append(time.perf_counter() - start)
        del result
        synchronize(devices)  # an unsynchronized call must not leak into the next one
    return spread(seconds)
