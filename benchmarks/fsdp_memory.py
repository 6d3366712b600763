"""What one process holds of a GPT-style model's training state under fsdp or pipeline, by
process count.

    python benchmarks/fsdp_memory.py [--width 256] [--depth 8] [--processes 1,2,3]
                                     [--strategy fsdp|pipeline]

M = bytes of the parameters + gradients + SGD-momentum buffers of the whole model. For each
process count N it trains three steps with ``--strategy fsdp`` on ``cpu`` processes (gloo;
on a machine with GPUs, ``--devices cuda`` puts one process per GPU) and reports, per
process: the bytes of the shards it holds after a step (``DTensor.to_local()`` sizes, taken
before ``zero_grad``), their ratio to M/N, and the peak resident memory (CPU) or peak
allocated memory (CUDA). N=1 is the one-process reference (``cpu``/``cuda``, no sharding).
With ``--strategy pipeline`` each process holds one stage (whole tensors of its layers).

``paratrain bench --script benchmarks/fsdp_memory.py:factory`` measures the same model
(``GPT_WIDTH``/``GPT_DEPTH`` in the environment) with every layout.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
from torch import nn

import paratrain
from paratrain.models import GPT, TokenCrossEntropy
from paratrain.tools.bench.memory import peak_rss_bytes, training_state_bytes

CONTEXT, VOCAB = 64, 256


def build(width: int, depth: int) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, width=width, depth=depth, heads=max(width // 64, 1), context=CONTEXT)


def sample_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(VOCAB, (n, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def factory() -> tuple[nn.Module, nn.Module, object]:
    """For ``paratrain bench --script``: the GPT of ``GPT_WIDTH``/``GPT_DEPTH``."""
    width = int(os.environ.get("GPT_WIDTH", "256"))
    depth = int(os.environ.get("GPT_DEPTH", "8"))
    return build(width, depth), TokenCrossEntropy(), sample_batch


def held(rt: paratrain.Runtime, width: int, depth: int) -> list[float]:
    model = build(width, depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    loss_fn = TokenCrossEntropy()
    state = 0
    for step in range(3):
        x, y = rt.to_device(sample_batch(8))
        rt.forward_backward(model, loss_fn, x, y)
        optimizer.step()
        if step == 2:
            state = training_state_bytes(model, optimizer)
        optimizer.zero_grad()
    peak = (
        torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda" else peak_rss_bytes()
    )
    return [float(state), float(peak or 0)]


def gathered(rt: paratrain.Runtime, width: int, depth: int) -> list[list[float]]:
    mine = torch.tensor(held(rt, width, depth), dtype=torch.float64)
    return [t.tolist() for t in rt.all_gather(mine)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--processes", default="1,2,3")
    parser.add_argument("--devices", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--strategy", choices=["fsdp", "pipeline"], default="fsdp")
    args = parser.parse_args()
    model = build(args.width, args.depth)
    params = sum(p.numel() for p in model.parameters())
    total = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"GPT width {args.width}, depth {args.depth}: {params:,} parameters")
    print(f"M = parameters + gradients + momentum = {total / 2**20:.1f} MiB")
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    for count in (int(n) for n in args.processes.split(",")):
        single = "cuda" if args.devices == "cuda" else "cpu"
        strategy = single if count == 1 else args.strategy
        devices = ",".join(f"cuda:{i}" if args.devices == "cuda" else "cpu" for i in range(count))
        rt = paratrain.Runtime(strategy=strategy, devices=devices)
        rows = rt.launch(gathered, args.width, args.depth)
        assert rows is not None
        for rank, (state, peak) in enumerate(rows):
            print(
                f"{strategy} N={count} rank {rank}: state {state / 2**20:.1f} MiB "
                f"({state / (total / count):.3f} x M/N), peak memory {peak / 2**20:.0f} MiB"
            )


if __name__ == "__main__":
    main()
