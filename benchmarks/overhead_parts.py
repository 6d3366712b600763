"""Where does the runtime's per-step cost go? The steps of ``benchmarks/overhead.py`` with
the runtime's parts added one at a time, each step timed on its own.

    python benchmarks/overhead_parts.py                  # a 1-wide MLP: the cost stands out
    python benchmarks/overhead_parts.py --width 256      # overhead.py's model

Contenders, each with its own model, optimizer and DataLoader (``make_parts`` of
``overhead.py``), all running the same loop step, each adding one part to the one before:

* ``plain``: the DataLoader, ``loss.backward()``;
* ``setup``: ``rt.setup(model, optimizer)``: the forward's wrapper (the micro-batch begins)
  and the optimizer's post-hook (the optimizer-step count), with ``loss.backward()``;
* ``backward``: and ``rt.backward(loss)``: the step pipeline's stages 3-6;
* ``paratrain-loader``: and ``rt.setup_loader(loader, data_path="loader")``: paratrain's
  sampler, each batch tagged with its loss weight and place in the epoch (the forward reads
  the tag): ``overhead.py``'s contender of that name.

Rounds run one step of each contender, in a new random order every round, so a machine that
slows down for a while slows every contender alike and each contender's code starts a step
after the others' evicted it from the caches, as a training loop's DataLoader and model do.
Prints each contender's median step, the median of its paired differences from ``plain``,
round by round, and from the contender before it: what that part costs. Steady state only:
rounds with an epoch's first step are left out.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from overhead import make_parts
from torch import nn

import paratrain
from paratrain.devices.machine import cpu_name

#: which of the runtime's parts a contender uses: the loader, setup, rt.backward (each
#: contender adds one to the one before)
PARTS: dict[str, tuple[bool, bool, bool]] = {
    "plain": (False, False, False),
    "setup": (False, True, False),
    "backward": (False, True, True),
    "paratrain-loader": (True, True, True),
}


class Contender:
    """One contender's parts and an endless supply of its batches."""

    def __init__(self, parts: tuple[bool, bool, bool], batch: int, steps: int, width: int) -> None:
        loader_part, setup_part, backward_part = parts
        rt = paratrain.Runtime(strategy="cpu", threads=torch.get_num_threads())
        model, optimizer, loader = make_parts(batch, steps, width)
        if setup_part:
            model, optimizer = rt.setup(model, optimizer)
        self.loader: Iterable[Any] = (
            rt.setup_loader(loader, data_path="loader") if loader_part else loader
        )
        self.model, self.optimizer = model, optimizer
        self.backward: Callable[[torch.Tensor], None] = (
            rt.backward if backward_part else torch.Tensor.backward
        )
        self.loss_fn = nn.CrossEntropyLoss()
        self._batches: Iterator[Any] = iter(())

    def step(self) -> int | None:
        """One training step; its time in ns, or None for an epoch's first step."""
        started = time.perf_counter_ns()
        try:
            x, y = next(self._batches)
        except StopIteration:
            self._batches = iter(self.loader)
            x, y = next(self._batches)
            started = None
        self.optimizer.zero_grad()
        self.backward(self.loss_fn(self.model(x), y))
        self.optimizer.step()
        return None if started is None else time.perf_counter_ns() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50, help="steps per epoch")
    parser.add_argument("--width", type=int, default=1, help="the MLP's hidden width")
    parser.add_argument("--rounds", type=int, default=2500, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=100, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contenders = {
        name: Contender(parts, args.batch, args.steps, args.width) for name, parts in PARTS.items()
    }
    order = list(contenders)
    names = list(contenders)
    before = dict(zip(names[1:], names, strict=False))  # the contender one part short
    took: dict[str, list[int]] = {name: [] for name in contenders}
    for round_index in range(args.warmup + args.rounds):
        random.shuffle(order)
        steps = {name: contenders[name].step() for name in order}
        if round_index < args.warmup or any(ns is None for ns in steps.values()):
            continue
        for name, ns in steps.items():
            assert ns is not None
            took[name].append(ns)
    print(
        f"# {cpu_name()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
        f"batch {args.batch}, width {args.width}, {len(took['plain'])} rounds of one step each"
    )
    for name in names:
        line = f"{name:>16}: median step {statistics.median(took[name]) / 1000:8.1f} us"
        if name in before:
            line += f", vs plain {_paired(took[name], took['plain']):+6.1f} us"
            line += f", its part {_paired(took[name], took[before[name]]):+6.1f} us"
        print(line)


def _paired(mine: list[int], theirs: list[int]) -> float:
    """The median of the rounds' differences, in µs."""
    return statistics.median(a - b for a, b in zip(mine, theirs, strict=True)) / 1000


if __name__ == "__main__":
    main()
