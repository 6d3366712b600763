"""How close `paratrain plan`'s prediction is to the peak measured over real tensors.

    python benchmarks/plan_accuracy.py [--strategies cpu,ddp,fsdp]

For digits (batch 64), cifar10-resnet18 (synthetic images, batch 8) and tiny-gpt at widths
64 and 256 (batch 16): the peak `paratrain plan` predicts on fake tensors for each layout,
and the peak measured by the same tracker (torch's ``MemTracker``; ``FSDPMemTracker`` under
fsdp) over real tensors while two steps train in real processes (``cpu``; ``ddp`` and
``fsdp`` on ``cpu,cpu`` with gloo). DDP's gradient buckets are allocated inside its C++
reducer, which the tracker does not see: the measured ddp peak leaves them out, the
prediction counts them.
"""

from __future__ import annotations

import argparse
import platform
from typing import Any

import torch
from torch import nn

import paratrain
from paratrain.commands.plan import recipe_builder
from paratrain.models import GPT
from paratrain.plan import plan_memory, trace_step

MODELS = {
    "digits": 64,
    "cifar10-resnet18": 8,
    "tiny-gpt width 64": 16,
    "tiny-gpt width 256": 16,
}


def builder(name: str) -> Any:
    if name.startswith("tiny-gpt"):
        width = int(name.rsplit(" ", 1)[1])

        def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = torch.randint(0, 64, (n, 33), generator=torch.Generator().manual_seed(0))
            return tokens[:, :-1], tokens[:, 1:]

        def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

        def build() -> Any:
            return GPT(width=width, depth=2), loss, lambda p: torch.optim.AdamW(p), sample

        return build
    synthetic = 64 if name == "cifar10-resnet18" else None
    return recipe_builder(name, synthetic=synthetic)[0]


def measure(rt: paratrain.Runtime, name: str, batch: int) -> int:
    """The peak bytes the tracker sees in this process over two real steps."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    model, loss_fn, make_optimizer, sample = builder(name)()
    optimizer = make_optimizer(model.parameters())
    model, optimizer = rt.setup(model, optimizer)
    x, y = sample(max(1, batch // rt.world_size))
    tracker: Any
    if rt.strategy.name == "fsdp":
        tracker = FSDPMemTracker(model, optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    with tracker:
        for _ in range(2):
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()
    totals = [d["Total"] for d in tracker.get_tracker_snapshot("peak").values()]
    return int(max(totals))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategies", default="cpu,ddp,fsdp")
    strategies = parser.parse_args().strategies.split(",")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(f"{'model':<20} {'layout':<8} {'predicted':>12} {'measured':>12} {'error':>8}")
    for name, batch in MODELS.items():
        build = builder(name)
        plan = plan_memory(
            lambda b, build=build: trace_step(build, b), name, batch, "32", 2, "cpu", 1 << 40, "-"
        )
        predicted = {p.layout: p.peak for p in plan.layouts}
        for strategy in strategies:
            devices = None if strategy == "cpu" else "cpu,cpu"
            measured = paratrain.Runtime(strategy, devices=devices).launch(measure, name, batch)
            assert measured is not None
            error = predicted[strategy] / measured - 1
            print(
                f"{name:<20} {strategy:<8} {predicted[strategy]:>12,} {measured:>12,} "
                f"{error:>+8.1%}"
            )


if __name__ == "__main__":
    main()
