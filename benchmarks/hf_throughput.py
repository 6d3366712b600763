"""A Hugging Face Llama's training throughput on one device: tokens/s and MFU of the
runtime the ``hf:`` recipe trains with, next to the plain Hugging Face loop.

    python benchmarks/hf_throughput.py                 # ~150M-parameter Llama, CUDA, bf16
    python benchmarks/hf_throughput.py --device cpu    # a tiny Llama: a minute on the CPU
    python benchmarks/hf_throughput.py --only plain-bf16 paratrain-bf16

Contenders, each on the same random tokens, AdamW, ``model(input_ids, labels=...).loss``:

* ``plain-fp32``: ``model.to(device)``, ``loss.backward()``, ``optimizer.step()``;
* ``plain-bf16``: the same under ``torch.autocast(dtype=torch.bfloat16)``;
* ``paratrain-bf16``: ``Runtime(precision="bf16")``, ``rt.setup`` and
  ``rt.forward_backward(model, None, x, y)`` (the model's own loss), as ``--recipe hf:...``;
* ``paratrain-bf16-fused``: the same with ``fused_optimizer=True``;
* ``plain-compile`` / ``paratrain-compile``: bf16 with ``torch.compile`` (``--compile``).

FLOPs of one training step are counted with ``FlopCounterMode`` (matrix products and
attention, forward and backward); MFU is the achieved rate over a bf16 (CUDA) or float32
(CPU) matmul peak measured on this machine. Needs ``transformers`` (``paratrain[hf]``).
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import paratrain
from paratrain.devices.machine import cpu_name

# this folder's GPU benchmark: the same device sync and matmul peak
from gpu_throughput import matmul_peak, synchronize  # isort: skip

Steps = Iterator[None]


@dataclass(frozen=True)
class Setup:
    device: torch.device
    batch: int
    context: int
    steps: int
    warmup: int
    hidden: int
    layers: int
    vocab: int


def build_model(setup: Setup) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=setup.vocab,
        hidden_size=setup.hidden,
        intermediate_size=setup.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=setup.layers,
        num_attention_heads=max(1, setup.hidden // 64),
        num_key_value_heads=max(1, setup.hidden // 64),
        max_position_embeddings=setup.context,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def batches(setup: Setup) -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    pool = torch.randint(0, setup.vocab, (8, setup.batch, setup.context), generator=generator)
    pool = pool.to(setup.device)
    while True:
        yield from pool


def adamw(model: nn.Module, fused: bool | None = None) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)


def plain(setup: Setup, bf16: bool, compile: bool = False) -> Steps:
    model = build_model(setup).to(setup.device)
    optimizer = adamw(model)
    forward: Callable[..., Any] = torch.compile(model) if compile else model
    for tokens in batches(setup):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(setup.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = forward(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        yield


def with_paratrain(setup: Setup, **options: Any) -> Steps:
    rt = paratrain.Runtime(strategy=setup.device.type, precision="bf16", **options)
    model = build_model(setup)
    model, optimizer = rt.setup(model, adamw(model))
    for tokens in batches(setup):
        optimizer.zero_grad(set_to_none=True)
        rt.forward_backward(model, None, tokens, tokens)
        optimizer.step()
        yield


CONTENDERS: dict[str, Callable[[Setup], Steps]] = {
    "plain-fp32": lambda s: plain(s, bf16=False),
    "plain-bf16": lambda s: plain(s, bf16=True),
    "paratrain-bf16": lambda s: with_paratrain(s),
    "paratrain-bf16-fused": lambda s: with_paratrain(s, fused_optimizer=True),
}
COMPILED: dict[str, Callable[[Setup], Steps]] = {
    "plain-compile": lambda s: plain(s, bf16=True, compile=True),
    "paratrain-compile": lambda s: with_paratrain(s, compile=True),
}


@dataclass
class Result:
    name: str
    warmup_seconds: float
    tokens_per_second: float
    peak_gib: float


def measure(name: str, make: Callable[[Setup], Steps], setup: Setup) -> Result:
    torch._dynamo.reset()
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(setup.device)
    steps = make(setup)
    synchronize(setup.device)
    start = time.perf_counter()
    for _ in range(setup.warmup):
        next(steps)
    synchronize(setup.device)
    warm = time.perf_counter()
    for _ in range(setup.steps):
        next(steps)
    synchronize(setup.device)
    elapsed = time.perf_counter() - warm
    steps.close()
    print(f"{name}: {tokens_per_second(setup, elapsed):,.0f} tokens/s", flush=True)
    peak = torch.cuda.max_memory_allocated(setup.device) if setup.device.type == "cuda" else 0
    return Result(name, warm - start, tokens_per_second(setup, elapsed), peak / 2**30)


def tokens_per_second(setup: Setup, elapsed: float) -> float:
    return setup.steps * setup.batch * setup.context / elapsed


def flops_per_token(setup: Setup) -> float:
    model = build_model(setup).to(setup.device)
    tokens = next(batches(setup))
    counter = FlopCounterMode(display=False)
    with counter:
        model(tokens, labels=tokens).loss.backward()
    return counter.get_total_flops() / tokens.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--batch", type=int, help="sequences per step; default 16 / 4")
    parser.add_argument("--context", type=int, help="tokens per sequence; default 1024 / 64")
    parser.add_argument("--hidden", type=int, help="default 768 / 64")
    parser.add_argument("--layers", type=int, help="default 12 / 2")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--steps", type=int, help="timed steps; default 40 / 10")
    parser.add_argument("--warmup", type=int, help="untimed steps first; default 10 / 3")
    parser.add_argument("--compile", action="store_true", help="add the compiled contenders")
    parser.add_argument("--only", nargs="+", choices=[*CONTENDERS, *COMPILED])
    args = parser.parse_args()
    kind = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    gpu = kind == "cuda"
    setup = Setup(
        device=torch.device("cuda", 0) if gpu else torch.device("cpu"),
        batch=args.batch or (16 if gpu else 4),
        context=args.context or (1024 if gpu else 64),
        steps=args.steps or (40 if gpu else 10),
        warmup=args.warmup or (10 if gpu else 3),
        hidden=args.hidden or (768 if gpu else 64),
        layers=args.layers or (12 if gpu else 2),
        vocab=args.vocab if gpu or args.vocab != 32_000 else 1024,
    )
    contenders = {**CONTENDERS, **(COMPILED if args.compile or args.only else {})}
    chosen = args.only or list(contenders)
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in plain-fp32
    flops = flops_per_token(setup)
    peak = matmul_peak(setup.device, bf16=gpu)
    params = sum(p.numel() for p in build_model(setup).parameters())
    name = torch.cuda.get_device_name(setup.device) if gpu else cpu_name()
    print(f"machine: {name}; {platform.system()}, torch {torch.__version__}")
    print(
        f"model: Llama, {params / 1e6:.1f}M parameters ({setup.layers} layers, hidden "
        f"{setup.hidden}, vocab {setup.vocab}); batch {setup.batch} x {setup.context} tokens; "
        f"{setup.steps} timed steps after {setup.warmup}; {flops / 1e9:.3f} GFLOP per token"
    )
    results = [measure(n, contenders[n], setup) for n in chosen]
    peak = max(peak, matmul_peak(setup.device, bf16=gpu))
    print(f"matmul peak {peak / 1e12:.1f} TFLOP/s ({'bf16' if gpu else 'float32'})")
    base = next((r.tokens_per_second for r in results if r.name == "plain-bf16"), None)
    print()
    print("| contender | tokens/s | vs plain-bf16 | TFLOP/s | MFU | peak GiB | warm-up |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        achieved = r.tokens_per_second * flops
        ratio = f"{r.tokens_per_second / base:.2f}" if base else "-"
        print(
            f"| {r.name} | {r.tokens_per_second:,.0f} | {ratio} | {achieved / 1e12:.1f} | "
            f"{achieved / peak:.1%} | {r.peak_gib:.1f} | {r.warmup_seconds:.1f}s |"
        )


if __name__ == "__main__":
    main()
