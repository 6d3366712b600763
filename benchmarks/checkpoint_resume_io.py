"""How long does a resumable checkpoint of the cifar10-resnet18 recipe take to write and read?

    python benchmarks/checkpoint_resume_io.py
    python benchmarks/checkpoint_resume_io.py --rounds 10 --dir /path/on/another/disk

Writes the checkpoint the training loop writes (ResNet-18 weights, SGD momentum state, the
generator states, state.json; every file flushed to disk, then the directory renamed), and
reads it back into a fresh model and optimizer as ``--resume`` does. Prints the median and
spread of each, the size on disk, and the machine.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from paratrain.checkpoints.state import (
    Checkpointer,
    Position,
    ProcessLayout,
    TrainingParts,
    load_checkpoint,
)
from paratrain.devices.machine import cpu_name
from paratrain.runtime.facade import Runtime
from paratrain.training.config import TrainConfig
from paratrain.training.recipes import get_recipe

BATCHES_PER_EPOCH = 195  # CIFAR-10's 50,000 images in batches of 256


def build(rt: Runtime, cfg: TrainConfig) -> TrainingParts:
    recipe = get_recipe(cfg.recipe)
    model = recipe.build_model(cfg)
    optimizer = recipe.build_optimizer(model.parameters(), cfg)
    model, optimizer = rt.setup(model, optimizer)
    return TrainingParts(model, optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    cfg = TrainConfig(recipe="cifar10-resnet18", synthetic=8).resolved(get_recipe)
    rt = Runtime(strategy="cpu")
    parts = build(rt, cfg)
    # One step, so that the optimizer holds its momentum buffers as during training.
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    torch.nn.functional.cross_entropy(parts.model(x), y).backward()
    parts.optimizer.step()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run = Path(tmp)
        layout = ProcessLayout(rt.strategy.collective, rt.strategy.devices, rt.strategy.name)
        # Written in this thread: the figures are the whole write.
        saver = Checkpointer(
            layout, run, cfg, parts, BATCHES_PER_EPOCH, Position(), background=False
        )
        writes, reads = [], []
        for round_ in range(args.rounds + 1):  # the first round warms up
            start = time.perf_counter()
            path = saver.save(0, round_ + 1, round_ + 1)
            elapsed = time.perf_counter() - start
            assert path is not None
            fresh = build(rt, cfg)
            start = time.perf_counter()
            load_checkpoint(layout, path, fresh, BATCHES_PER_EPOCH)
            if round_:
                writes.append(elapsed)
                reads.append(time.perf_counter() - start)
        files = list(path.iterdir())
        size = sum(p.stat().st_size for p in files)

    print(f"cifar10-resnet18 checkpoint: {size / 2**20:.1f} MiB in {len(files)} files")
    for name, times in (("write", writes), ("read", reads)):
        median = statistics.median(times)
        spread = max(times) - min(times)
        print(f"{name:5s}  median {median * 1000:7.1f} ms  spread {spread * 1000:6.1f} ms")
    print(f"{args.rounds} rounds; {cpu_name()}, {platform.system()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
