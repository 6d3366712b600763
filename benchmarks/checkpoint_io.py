"""How long saving and loading the cifar10-resnet18 model's weights takes on this machine.

    python benchmarks/checkpoint_io.py [--repeats 7]

Times paratrain's safetensors path (``save_weights``, ``load_weights``) and, for comparison,
``torch.save`` / ``torch.load(weights_only=True)`` of the same state dict (wrapped in
DataParallel, so ``load_weights`` also strips ``module.``). Prints median and spread of
``--repeats`` runs after one warm-up, the file sizes, and the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import paratrain
from paratrain.checkpoints.weights import save_weights
from paratrain.models import resnet18


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up: first-touch page faults, lazy imports
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def line(name: str, seconds: list[float]) -> str:
    median, low, high = (1e3 * f(seconds) for f in (statistics.median, min, max))
    return f"{name:<43} median {median:7.1f} ms  (min {low:.1f}, max {high:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    model = resnet18(num_classes=10)
    target = resnet18(num_classes=10)
    state_dp = nn.DataParallel(model).state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        st_path, pt_path = Path(tmp) / "model.safetensors", Path(tmp) / "model.pt"
        results = {
            "write safetensors (save_weights)": timed(
                lambda: save_weights(model, st_path), args.repeats
            ),
            "read safetensors into model (load_weights)": timed(
                lambda: paratrain.load_weights(target, st_path), args.repeats
            ),
            "write torch.save (module. keys)": timed(
                lambda: torch.save(state_dp, pt_path), args.repeats
            ),
            "read torch.save into model (load_weights)": timed(
                lambda: paratrain.load_weights(target, pt_path), args.repeats
            ),
            "torch.load(weights_only=True) alone": timed(
                lambda: torch.load(pt_path, weights_only=True), args.repeats
            ),
        }
        sizes = {path.name: path.stat().st_size for path in (st_path, pt_path)}

    params = sum(p.numel() for p in model.parameters())
    print(f"cifar10-resnet18 weights: {params:,} parameters, {len(state_dp)} tensors")
    for name, size in sizes.items():
        print(f"  {name}: {size:,} bytes ({size / 2**20:.1f} MiB)")
    for name, seconds in results.items():
        print(line(name, seconds))
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"paratrain {paratrain.__version__}; {args.repeats} repeats after 1 warm-up; "
        f"files in {tempfile.gettempdir()}"
    )


if __name__ == "__main__":
    main()
