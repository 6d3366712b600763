"""Training throughput on this machine's GPU (or, without one, on the CPU, smaller):
how paratrain compares with the loops people write, with and without its speed options.

    python benchmarks/gpu_throughput.py               # ResNet-18 (CIFAR stem), batch 256 on CUDA
    python benchmarks/gpu_throughput.py --batch 512
    python benchmarks/gpu_throughput.py --device cpu  # a small CNN, 2,048 images: a minute or two

Contenders, each on the same synthetic CIFAR-shaped data, same model, SGD with momentum:

* ``seed-004``: a per-sample Dataset of uint8 images, a ToTensor-and-normalize transform per
  sample, a DataLoader with worker processes, float32;
* ``plain``: ``DataLoader(TensorDataset)`` of normalized float32 images, float32;
* ``paratrain``: the runtime with its defaults (on CUDA: channels last for convolutions,
  fused SGD);
* ``paratrain-all``: every speed option: ``compile=True``, ``channels_last=True``, bf16
  where the device supports it (CUDA), ``fused_optimizer=True``, and the fastest data path
  (``--data-path``, default ``auto``: device-resident batches on a GPU, batched on the CPU);
* ``expert``: a hand-tuned loop for reference: uint8 images resident on the device and
  normalized there, channels last, bf16 (CUDA), fused SGD, ``torch.compile``.

Every contender trains ``--warmup`` steps first (compilation, cuDNN autotuning, worker
start-up: reported as ``warm-up``), then is timed over ``--images`` images. FLOPs of one
training step are counted with ``torch.utils.flop_counter.FlopCounterMode`` (convolutions
and matrix products, forward and backward); MFU is the achieved rate over a matmul peak
measured here (bf16 on CUDA, float32 on the CPU).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

import paratrain
from paratrain.data.cifar import CIFAR_MEAN, CIFAR_STD
from paratrain.devices.machine import cpu_name
from paratrain.models import resnet18

Steps = Iterator[None]  # each next() trains one step


@dataclass(frozen=True)
class Setup:
    device: torch.device
    batch: int
    images: int
    warmup: int
    workers: int
    model: str
    data_path: str
    bf16: bool


def small_cnn() -> nn.Module:
    """Three conv blocks: enough convolution work to mean something on a few CPU cores."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32),
        nn.MaxPool2d(2),
        *block(32, 64),
        nn.MaxPool2d(2),
        *block(64, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def build_model(setup: Setup) -> nn.Module:
    torch.manual_seed(0)
    return resnet18(num_classes=10, cifar_stem=True) if setup.model == "resnet18" else small_cnn()


def sgd(params: Any, fused: bool | None = None) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=5e-4, fused=fused)


# -- data --------------------------------------------------------------------------------------
@dataclass
class Data:
    images: torch.Tensor  # uint8 (N, 3, 32, 32)
    labels: torch.Tensor  # int64 (N,)

    @property
    def normalized(self) -> torch.Tensor:
        mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
        return (self.images.float() / 255 - mean) / std


def make_data(n: int) -> Data:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=generator)
    return Data(images, torch.randint(0, 10, (n,), generator=generator))


class PerSampleImages(Dataset[tuple[torch.Tensor, int]]):
    """What seed 004 did: HWC uint8 images, a ToTensor-like transform for every sample."""

    def __init__(self, data: Data) -> None:
        self.images = data.images.permute(0, 2, 3, 1).numpy()  # HWC, as PIL/torchvision
        self.labels = data.labels.tolist()
        self.mean = np.array(CIFAR_MEAN, dtype=np.float32).reshape(3, 1, 1)
        self.std = np.array(CIFAR_STD, dtype=np.float32).reshape(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        chw = self.images[index].transpose(2, 0, 1).astype(np.float32) / 255.0
        return torch.from_numpy((chw - self.mean) / self.std), self.labels[index]


# -- the contenders ----------------------------------------------------------------------------
def loop_steps(loader: Any, step: Callable[[torch.Tensor, torch.Tensor], None]) -> Steps:
    while True:
        for x, y in loader:
            step(x, y)
            yield


def plain_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    return step


def seed_004(setup: Setup, data: Data) -> Steps:
    model = build_model(setup).to(setup.device)
    loader = DataLoader(
        PerSampleImages(data),
        batch_size=setup.batch,
        shuffle=True,
        num_workers=setup.workers,
        pin_memory=setup.device.type == "cuda",
        drop_last=True,
    )
    return loop_steps(loader, plain_step(model, sgd(model.parameters()), setup.device))


def plain(setup: Setup, data: Data) -> Steps:
    model = build_model(setup).to(setup.device)
    dataset = TensorDataset(data.normalized, data.labels)
    loader = DataLoader(dataset, batch_size=setup.batch, shuffle=True, drop_last=True)
    return loop_steps(loader, plain_step(model, sgd(model.parameters()), setup.device))


def paratrain_steps(setup: Setup, data: Data, **options: Any) -> Steps:
    rt = paratrain.Runtime(strategy=setup.device.type, **options)
    model = build_model(setup)
    model, optimizer = rt.setup(model, sgd(model.parameters()))
    dataset = TensorDataset(data.normalized, data.labels)
    loader = DataLoader(dataset, batch_size=setup.batch, shuffle=True, drop_last=True)
    # The defaults contender keeps the default data path; the other asks for --data-path.
    path = setup.data_path if options else "auto"
    device_loader = rt.setup_loader(loader, data_path=path)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        rt.backward(loss_fn(model(x), y))
        optimizer.step()

    return loop_steps(device_loader, step)


def paratrain_defaults(setup: Setup, data: Data) -> Steps:
    return paratrain_steps(setup, data)


def paratrain_all(setup: Setup, data: Data) -> Steps:
    precision = "bf16" if setup.bf16 else "32"
    return paratrain_steps(
        setup, data, compile=True, channels_last=True, precision=precision, fused_optimizer=True
    )


def expert(setup: Setup, data: Data) -> Steps:
    device = setup.device
    model = build_model(setup).to(device, memory_format=torch.channels_last)
    optimizer = sgd(model.parameters(), fused=True)
    compiled = torch.compile(model)
    images, labels = data.images.to(device), data.labels.to(device)
    mean = torch.tensor(CIFAR_MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(CIFAR_STD, device=device).view(1, 3, 1, 1) * 255
    dtype = torch.bfloat16 if setup.bf16 else None
    loss_fn = nn.CrossEntropyLoss()
    batches = len(labels) // setup.batch
    while True:
        order = torch.randperm(len(labels), device=device)
        for index in range(batches):
            chosen = order[index * setup.batch : (index + 1) * setup.batch]
            x = ((images[chosen].float() - mean) / std).contiguous(
                memory_format=torch.channels_last
            )
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(compiled(x), labels[chosen])
            loss.backward()
            optimizer.step()
            yield


CONTENDERS: dict[str, Callable[[Setup, Data], Steps]] = {
    "seed-004": seed_004,
    "plain": plain,
    "paratrain": paratrain_defaults,
    "paratrain-all": paratrain_all,
    "expert": expert,
}


# -- measuring ---------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Result:
    name: str
    warmup_seconds: float
    images_per_second: float


def measure(name: str, setup: Setup, data: Data) -> Result:
    torch._dynamo.reset()  # every compiling contender pays its own compilation
    steps = CONTENDERS[name](setup, data)
    synchronize(setup.device)
    start = time.perf_counter()
    for _ in range(setup.warmup):
        next(steps)
    synchronize(setup.device)
    warm = time.perf_counter()
    timed = max(1, setup.images // setup.batch)
    for _ in range(timed):
        next(steps)
    synchronize(setup.device)
    elapsed = time.perf_counter() - warm
    steps.close()
    return Result(name, warm - start, timed * setup.batch / elapsed)


def flops_per_image(setup: Setup) -> float:
    """Convolution and matmul FLOPs of one training step (forward + backward), per image."""
    model = build_model(setup).to(setup.device)
    x = torch.randn(setup.batch, 3, 32, 32, device=setup.device)
    y = torch.randint(0, 10, (setup.batch,), device=setup.device)
    counter = FlopCounterMode(display=False)
    with counter:
        nn.functional.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / setup.batch


def matmul_peak(device: torch.device, bf16: bool) -> float:
    """FLOP/s of a large square matmul here: bf16 on CUDA, float32 on the CPU."""
    n = 8192 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if bf16 else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    torch.mm(a, b)
    for _ in range(5):
        repeats = 20 if device.type == "cuda" else 5
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        synchronize(device)
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - start))
    return best


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--batch", type=int, help="default: 256 on CUDA, 64 on the CPU")
    parser.add_argument("--images", type=int, help="timed images; default 50,000 / 2,048")
    parser.add_argument("--warmup", type=int, help="untimed steps first; default 30 / 5")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--model", choices=("resnet18", "small"), help="default by device")
    parser.add_argument("--data-path", default="auto", help="setup_loader(data_path=...)")
    parser.add_argument("--only", nargs="+", choices=list(CONTENDERS), help="a subset")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: its own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kind = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    gpu = device.type == "cuda"
    setup = Setup(
        device=device,
        batch=args.batch or (256 if gpu else 64),
        images=args.images or (50_000 if gpu else 2_048),
        warmup=args.warmup or (30 if gpu else 5),
        workers=args.workers,
        model=args.model or ("resnet18" if gpu else "small"),
        data_path=args.data_path,
        bf16=gpu and torch.cuda.is_bf16_supported(),
    )
    data = make_data(max(setup.images, setup.batch * (setup.warmup + 1)))
    flops = flops_per_image(setup)
    peak = matmul_peak(device, setup.bf16)
    print(f"machine: {machine(device)}; {platform.system()}, torch {torch.__version__}")
    print(
        f"model: {setup.model}, batch {setup.batch}, {setup.images:,} timed images after "
        f"{setup.warmup} warm-up steps; {flops / 1e9:.3f} GFLOP per image per training step; "
        f"data path of paratrain-all: {setup.data_path}"
    )
    results = [measure(name, setup, data) for name in args.only or CONTENDERS]
    peak = max(peak, matmul_peak(device, setup.bf16))  # the best of before and after
    print(f"matmul peak {peak / 1e12:.3f} TFLOP/s ({'bf16' if setup.bf16 else 'float32'})")
    base = next((r.images_per_second for r in results if r.name == "plain"), None)
    print()
    print("| contender | images/s | vs plain | TFLOP/s | MFU | warm-up |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        achieved = r.images_per_second * flops
        ratio = f"{r.images_per_second / base:.2f}" if base else "-"
        print(
            f"| {r.name} | {r.images_per_second:,.0f} | {ratio} | {achieved / 1e12:.3f} | "
            f"{achieved / peak:.1%} | {r.warmup_seconds:.1f}s |"
        )


if __name__ == "__main__":
    main()
