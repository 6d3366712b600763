"""What does the runtime cost per step? Plain PyTorch vs paratrain (vs Accelerate and
Lightning Fabric when installed), same model and data on the CPU, interleaved rounds.

    python benchmarks/overhead.py                 # pytorch and paratrain
    pip install "paratrain[peers]"                # adds accelerate and fabric
    python benchmarks/overhead.py --rounds 30
    python benchmarks/overhead.py --collective-check   # ddp on cpu,cpu: the order check's cost
    python benchmarks/overhead.py --ddp-step           # ddp on cpu,cpu: a step vs plain DDP

Prints one line per contender: median step time, spread, and the ratio to plain PyTorch:
the median of the rounds' ratios (a round runs every contender once, within a second, so a
machine that slows down for a while slows both sides of a ratio alike; the ratio of the
medians follows in brackets), by wall clock and, with one thread, by this process's CPU time,
which a busy machine's waits for a core do not inflate. Where even that is too noisy,
``benchmarks/overhead_instructions.py`` counts the instructions of the same steps, which
no other work on the machine changes.
``paratrain`` sets the loader up with the default data path (``auto``: on the CPU, batches
cut out of the TensorDataset by index); ``paratrain-loader`` keeps the DataLoader's
per-sample path, which shows the runtime's own cost. ``--collective-check`` instead trains
``ddp`` on two CPU processes with the collective order check
(:mod:`paratrain.distributed.collective_order`) running and stopped, in interleaved rounds.
``--ddp-step`` times, in the same two CPU processes, a step as ``paratrain train`` runs it
(``rt.forward_backward`` under ``--oom auto``, ``optimizer.step()``, ``rt.should_stop()``)
against plain DistributedDataParallel, and counts the small all-reduces of each (torch's
profiler): run it with ``PYTHONPATH`` pointing at two versions of paratrain to compare them.
``--ddp-step --oom off`` times a loop of one's own instead (``model(x)``, ``rt.backward``,
``optimizer.step()``, ``rt.should_stop()`` with the runtime's defaults: the step's checks read
one step late, at the default pace of about a second); ``--width 512`` is the 512-wide MLP;
``--agreement-seconds 0`` agrees on the step's checks at every step
(:mod:`paratrain.runtime.agreement`).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import random
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paratrain.devices.machine import cpu_name

EpochFn = Callable[[], int]  # runs one epoch, returns the number of steps
#: what a contender trains with: its batches, model, optimizer and backward
Parts = tuple[Iterable[Any], nn.Module, Any, Callable[[torch.Tensor], None]]


def make_parts(
    batch: int, steps: int, width: int = 256
) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch * steps, 64)
    y = torch.randint(0, 10, (batch * steps,))
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    return model, optimizer, loader


def train_step(model: nn.Module, optimizer: Any, backward: Callable[[torch.Tensor], None]) -> Any:
    """One step of the loop every contender runs; only how its parts were prepared differs."""
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        backward(loss)
        optimizer.step()

    return step


def epoch_fn(
    loader: Iterable[Any],
    model: nn.Module,
    optimizer: Any,
    backward: Callable[[torch.Tensor], None],
) -> EpochFn:
    """The same loop for every contender: an epoch of :func:`train_step`."""
    step = train_step(model, optimizer, backward)

    def epoch() -> int:
        n = 0
        for x, y in loader:
            step(x, y)
            n += 1
        return n

    return epoch


def plain_pytorch(batch: int, steps: int) -> Parts:
    model, optimizer, loader = make_parts(batch, steps)
    return loader, model, optimizer, torch.Tensor.backward


def paratrain_runtime(batch: int, steps: int, data_path: str = "auto") -> Parts:
    import paratrain

    # the count main() set, for every contender alike (the runtime would choose its own)
    rt = paratrain.Runtime(strategy="cpu", threads=torch.get_num_threads())
    model, optimizer, loader = make_parts(batch, steps)
    model, optimizer = rt.setup(model, optimizer)
    return rt.setup_loader(loader, data_path=data_path), model, optimizer, rt.backward


def accelerate_loop(batch: int, steps: int) -> Parts:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = make_parts(batch, steps)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return loader, model, optimizer, accelerator.backward


def fabric_loop(batch: int, steps: int) -> Parts:
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer, loader = make_parts(batch, steps)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric.setup_dataloaders(loader), model, optimizer, fabric.backward


CONTENDERS: dict[str, tuple[Callable[[int, int], Parts], str | None]] = {
    "pytorch": (plain_pytorch, None),
    "paratrain": (paratrain_runtime, None),
    "paratrain-loader": (functools.partial(paratrain_runtime, data_path="loader"), None),
    "accelerate": (accelerate_loop, "accelerate"),
    "fabric": (fabric_loop, "lightning_fabric"),
}


def installed(name: str) -> bool:
    """Whether a contender's package is installed (else it is skipped, said in one line)."""
    module = CONTENDERS[name][1]
    if module is None or importlib.util.find_spec(module) is not None:
        return True
    print(f"{name:>16}: skipped ({module} is not installed: pip install 'paratrain[peers]')")
    return False


def _check_rounds(rt: Any, batch: int, steps: int, rounds: int, warmup: int) -> dict[str, Any]:
    """In each ddp process: the same epochs with the order check running, then stopped."""
    from paratrain.distributed import collective_order

    model, optimizer, loader = make_parts(batch, steps)
    model, optimizer = rt.setup(model, optimizer)
    epoch = epoch_fn(rt.setup_loader(loader), model, optimizer, rt.backward)
    names = ("check on", "check off")
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # the thread's work included
    shuffler = random.Random(0)  # the same order on both processes
    for round_index in range(warmup + rounds):
        order = list(names)
        shuffler.shuffle(order)
        for name in order:
            if name == "check on":
                collective_order.start(rt.rank, rt.world_size)
            else:
                collective_order.stop()
            rt.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            steps_done = epoch()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if round_index >= warmup:
                times[name].append(elapsed / steps_done)
                cpu[name].append(elapsed_cpu / steps_done)
    for name in names:
        times[f"{name} (cpu)"] = cpu[name]
    ledger = collective_order.Ledger()
    start = time.perf_counter()
    for _ in range(100_000):
        with ledger.operation("rt.backward"):
            pass
    times["ledger per collective"] = [(time.perf_counter() - start) / 100_000]
    return times


def collective_check(args: argparse.Namespace) -> None:
    import paratrain

    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu")
    times = rt.launch(_check_rounds, args.batch, args.steps, args.rounds, args.warmup)
    assert times is not None
    print(
        f"# {cpu_name()}, ddp on cpu,cpu (gloo), torch {torch.__version__}, batch {args.batch}, "
        f"{args.steps} steps x {args.rounds} rounds"
    )
    for kind in ("", " (cpu)"):
        base = statistics.median(times[f"check off{kind}"])
        for name in (f"check off{kind}", f"check on{kind}"):
            median = statistics.median(times[name])
            print(
                f"{name:>16}: median step {median * 1e6:8.1f} us "
                f"(min {min(times[name]) * 1e6:.1f}), ratio {median / base:.3f}"
            )
    base = statistics.median(times["check off"])
    ledger = times["ledger per collective"][0]
    print(f"{'ledger':>16}: {ledger * 1e6:.2f} us per collective ({ledger / base:.2%} of a step)")


def _step_rounds(
    rt: Any, batch: int, steps: int, rounds: int, warmup: int, width: int = 256
) -> dict[str, Any]:
    """In each ddp process: paratrain's step and plain DDP's on the same batches, in
    interleaved rounds; and the small all-reduces of one paratrain step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile

    model, optimizer, _ = make_parts(batch, 1, width)
    plain_model, plain_optimizer, _ = make_parts(batch, 1, width)
    model, optimizer = rt.setup(model, optimizer)
    plain = DistributedDataParallel(plain_model)
    generator = torch.Generator().manual_seed(0)
    samples = TensorDataset(
        torch.randn(batch * steps, 64, generator=generator),
        torch.randint(0, 10, (batch * steps,), generator=generator),
    )
    # paratrain's batches come from rt.setup_loader (the same number on every process: the
    # step's checks are agreed at the main process's pace); plain DDP trains on the same
    # tensors. Both are taken out of the loader once, so that no loader is timed.
    data = list(rt.setup_loader(DataLoader(samples, batch_size=batch)))
    plain_data = [(x.clone(), y.clone()) for x, y in data]
    loss_fn = nn.CrossEntropyLoss()

    def paratrain_epoch() -> None:
        for x, y in data:
            if rt.micro_batches.active:  # paratrain train's step
                rt.forward_backward(model, loss_fn, x, y)
            else:  # a loop of one's own
                rt.backward(loss_fn(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            rt.should_stop()

    def plain_epoch() -> None:
        for x, y in plain_data:
            loss_fn(plain(x), y).backward()
            plain_optimizer.step()
            plain_optimizer.zero_grad()

    epochs = {"paratrain": paratrain_epoch, "plain DDP": plain_epoch}
    times: dict[str, list[float]] = {name: [] for name in epochs}
    shuffler = random.Random(0)  # the same order on both processes
    for round_index in range(warmup + rounds):
        order = list(epochs)
        shuffler.shuffle(order)
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            epochs[name]()
            if round_index >= warmup:
                times[name].append((time.perf_counter() - start) / steps)
    small: dict[str, list[float]] = {}
    for name, epoch in epochs.items():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            epoch()
        sizes = [
            torch.Size(e.input_shapes[0]).numel()
            for e in prof.events()
            if e.name == "gloo:all_reduce" and e.input_shapes and e.input_shapes[0]
        ]
        small[name] = [sum(size < 64 for size in sizes) / steps]  # the gradients: 85k numbers
    return {"times": times, "small": small}


def ddp_step(args: argparse.Namespace) -> None:
    import paratrain

    rt = paratrain.Runtime(
        strategy="ddp", devices="cpu,cpu", oom=args.oom, agreement_seconds=args.agreement_seconds
    )
    found = rt.launch(_step_rounds, args.batch, args.steps, args.rounds, args.warmup, args.width)
    assert found is not None
    times, small = found["times"], found["small"]
    print(
        f"# {cpu_name()}, ddp on cpu,cpu (gloo), torch {torch.__version__}, paratrain "
        f"{paratrain.__version__} from {Path(paratrain.__file__).parent}, batch {args.batch}, "
        f"width {args.width}, --oom {args.oom}, agreement_seconds {args.agreement_seconds}, "
        f"{args.steps} steps x {args.rounds} rounds"
    )
    base = times["plain DDP"]
    for name, samples in times.items():
        median = statistics.median(samples)
        print(
            f"{name:>16}: median step {median * 1e6:8.1f} us (min {min(samples) * 1e6:.1f}), "
            f"ratio {paired_ratio(samples, base):.3f} (of the medians "
            f"{median / statistics.median(base):.3f}), small all-reduces per step "
            f"{small[name][0]:g}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed epoch")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--collective-check", action="store_true", help="ddp on cpu,cpu: check on vs off"
    )
    parser.add_argument(
        "--ddp-step", action="store_true", help="ddp on cpu,cpu: paratrain's step vs plain DDP"
    )
    parser.add_argument(
        "--oom",
        choices=("auto", "off"),
        default="auto",
        help="--ddp-step: auto times paratrain train's step, off a loop of one's own",
    )
    parser.add_argument("--width", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument(
        "--agreement-seconds",
        type=float,
        default=1.0,
        help="--ddp-step: the runtime's agreement_seconds (default 1: at the main process's "
        "pace on rt.setup_loader's batches; 0: the step's checks agree every step)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.collective_check:
        collective_check(args)
        return
    if args.ddp_step:
        ddp_step(args)
        return

    epochs = {
        name: epoch_fn(*build(args.batch, args.steps))
        for name, (build, _) in CONTENDERS.items()
        if installed(name)
    }
    times: dict[str, list[float]] = {name: [] for name in epochs}
    # this process's CPU time too: on a busy machine the time spent waiting for a core is
    # not the contender's, and wall-clock ratios then drift by several percent
    cpu_times: dict[str, list[float]] = {name: [] for name in epochs}
    order = list(epochs)
    for round_index in range(args.warmup + args.rounds):
        random.shuffle(order)  # interleave: drift in machine speed hits every contender alike
        for name in order:
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            steps = epochs[name]()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if round_index >= args.warmup:
                times[name].append(elapsed / steps)
                cpu_times[name].append(elapsed_cpu / steps)
    print(
        f"# {cpu_name()}, {torch.get_num_threads()} thread(s), "
        f"torch {torch.__version__}, batch {args.batch}, {args.steps} steps x {args.rounds} rounds"
    )
    print_ratios(times, cpu_times if args.threads == 1 else None)


def paired_ratio(samples: list[float], base: list[float]) -> float:
    """The median of each round's ratio: a round's contenders run within a second of each
    other, so a machine that slows down for a while slows both sides of each ratio."""
    return statistics.median(mine / theirs for mine, theirs in zip(samples, base, strict=True))


def print_ratios(times: dict[str, list[float]], cpu_times: dict[str, list[float]] | None) -> None:
    """One line per contender: the median step, and its ratio to plain PyTorch's, round by
    round (and by CPU time: with one thread the step's own work)."""
    base = times["pytorch"]
    for name, samples in times.items():
        cpu = ""
        if cpu_times is not None:
            cpu = f", CPU time {paired_ratio(cpu_times[name], cpu_times['pytorch']):.3f}"
        print(
            f"{name:>16}: median step {statistics.median(samples) * 1e6:8.1f} us "
            f"(min {min(samples) * 1e6:.1f}, max {max(samples) * 1e6:.1f}), "
            f"ratio {paired_ratio(samples, base):.3f}{cpu} "
            f"(of the medians {statistics.median(samples) / statistics.median(base):.3f})"
        )


if __name__ == "__main__":
    main()
