"""Peak host memory per process while a GPT-style model is built, on the meta device
(paratrain.models.meta_init) or whole (the eager way), by layout.

    python benchmarks/meta_init_memory.py [--width 768] [--depth 8]

Each layout builds the model in each of its processes and sets it up (``rt.setup``): the
build's peak is the process's peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs`` just before the build) less its resident memory just before.
Printed per process next to the bytes of the part it keeps and of the largest block: a
meta build should peak near part + largest block (fsdp materialises one block at a time);
the eager build holds the whole model in every process first.

The processes run with ``MALLOC_MMAP_THRESHOLD_=65536`` (unless set): glibc otherwise raises
its mmap threshold after the first large free and keeps later blocks in a heap that
fragments, so the resident peak shows the allocator's slack rather than the build's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

import paratrain
from paratrain.models import GPT

VOCAB, CONTEXT = 256, 64
MIB = 2**20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _build(rt: paratrain.Runtime, width: int, depth: int, meta: bool, out: str) -> float:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
    before = _status("VmRSS")
    device = torch.device("meta") if meta else torch.device("cpu")
    with device:
        model = GPT(VOCAB, width, depth, max(width // 64, 1), CONTEXT)
    whole = _bytes(list(model.parameters()))
    block = _bytes(list(model.blocks[0].parameters()))
    wrapped = rt.setup(model)
    peak = _status("VmHWM") - before
    held = wrapped.parameters()
    part = _bytes([p.to_local() if hasattr(p, "to_local") else p for p in held])
    figures = {"peak": peak, "part": part, "block": block, "whole": whole}
    Path(out, f"rank{rt.rank}.json").write_text(json.dumps(figures))
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--layouts", default="cpu,fsdp,pipeline")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"GPT width {args.width}, depth {args.depth}; MiB per process (rank 0 / rank 1)")
    print(f"{'layout':<22}{'build':<7}{'peak':>16}{'part':>16}{'largest block':>15}{'whole':>9}")
    layouts = [("cpu", None), ("fsdp", "cpu,cpu"), ("pipeline", "cpu,cpu")]
    for strategy, devices in [x for x in layouts if x[0] in args.layouts.split(",")]:
        for meta in (True, False):
            with tempfile.TemporaryDirectory() as out:
                rt = paratrain.Runtime(strategy, devices=devices, seed=0)
                rt.launch(_build, args.width, args.depth, meta, out)
                ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
            peak = " / ".join(f"{r['peak'] / MIB:.0f}" for r in ranks)
            part = " / ".join(f"{r['part'] / MIB:.0f}" for r in ranks)
            first = ranks[0]
            name = f"{strategy} x{len(ranks)}" if devices else strategy
            print(
                f"{name:<22}{'meta' if meta else 'eager':<7}{peak:>16}{part:>16}"
                f"{first['block'] / MIB:>15.0f}{first['whole'] / MIB:>9.0f}"
            )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned processes
    main()
