"""What does the runtime cost per step, in instructions? The steps of
``benchmarks/overhead.py`` (the same model, data, loop and contenders), each contender in a
process of its own under valgrind's callgrind, which counts the instructions the steps run:
the same count on an idle machine and a busy one, where step times move by 10% or more.

    python benchmarks/overhead_instructions.py              # needs valgrind on PATH
    python benchmarks/overhead_instructions.py --steps 40

Only the steps are counted (``itertools.starmap`` runs them, and callgrind collects inside
it alone); importing torch, building the contender and warm-up steps run uninstrumented.
Instructions are not time: a Python call costs more time per instruction than a matrix
product, so a contender's overhead in time is larger than its share of instructions. Use it
to compare versions of the runtime and contenders with each other, with
``benchmarks/overhead.py`` for time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from overhead import CONTENDERS, installed, train_step

WARMUP = 5


def count_steps(name: str, batch: int, steps: int) -> None:
    """In the child under callgrind: build ``name``, warm up, then run ``steps`` steps inside
    ``itertools.starmap``, the one place callgrind collects."""
    torch.set_num_threads(1)
    build, _ = CONTENDERS[name]
    loader, model, optimizer, backward = build(batch, WARMUP + steps)
    step = train_step(model, optimizer, backward)
    batches = iter(loader)
    for _ in range(WARMUP):
        step(*next(batches))
    # instrument from here on (callgrind started uninstrumented: import torch runs at full
    # speed); this process keeps running while callgrind_control waits for it to listen
    control = subprocess.Popen(
        ["callgrind_control", "--instr=on", str(os.getpid())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while control.poll() is None:
        sum(range(1000))
    list(itertools.starmap(step, itertools.islice(batches, steps)))


def instructions(name: str, batch: int, steps: int) -> int:
    """The instructions of ``steps`` steps of ``name``, counted in a child process."""
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no"]
    valgrind += ["--toggle-collect=starmap_next", "--callgrind-out-file=/dev/null"]
    child_args = ["--child", name, "--batch", str(batch), "--steps", str(steps)]
    with subprocess.Popen(
        [*valgrind, sys.executable, str(Path(__file__).resolve()), *child_args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        _, err = child.communicate()
    found = re.search(r"Collected : (\d+)", err)
    if child.returncode != 0 or found is None:
        raise SystemExit(f"{name}: callgrind did not count it:\n{err[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="steps counted per contender")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        count_steps(args.child, args.batch, args.steps)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed (apt install valgrind): nothing counted")
    print(
        f"# instructions per step (callgrind), torch {torch.__version__}, batch {args.batch}, "
        f"{args.steps} steps each, one thread"
    )
    names = [name for name in CONTENDERS if installed(name)]
    # one child per core at a time: a count does not depend on what else runs
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        counts = list(pool.map(lambda name: instructions(name, args.batch, args.steps), names))
    base = counts[0] / args.steps  # pytorch
    for name, count in zip(names, counts, strict=True):
        per_step = count / args.steps
        ratio = per_step / base
        print(f"{name:>16}: {per_step / 1e6:8.3f} M instructions a step, ratio {ratio:.4f}")


if __name__ == "__main__":
    main()
