"""How long `paratrain doctor` takes on large scripts: it should grow with the size, not faster.

    python benchmarks/doctor_speed.py [--sizes 50,100,200,1000,5000] [--repeats 1]

Builds scripts of the given sizes (KB) by concatenating the real public scripts of
``tests/doctor_scripts/real`` (each copy's functions renamed, so that the file stays one
program with thousands of functions, classes, loaders and saves), then times
``paratrain.tools.doctor.diagnose`` on each: median of ``--repeats`` runs, CPU time of this process
(wall time on a busy machine says more about the neighbours than about doctor), and the
findings. Then a script of ``--loaders`` DataLoaders, each with its DistributedSampler
(about 100 bytes a loader: 2,000 make 200 KB), where a rule that compares every loader with
every sampler shows. Also reads a 200,000-term expression, which must fail with one line.
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

from paratrain.tools.doctor import diagnose
from paratrain.utils.errors import UserError

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "doctor_scripts" / "real"


def build(size: int) -> str:
    sources = [p.read_text("utf-8") for p in sorted(CORPUS.glob("*.py"))]
    parts: list[str] = []
    total, copy = 0, 0
    while total < size:
        for source in sources:
            renamed = re.sub(r"^(\s*)def (\w+)", rf"\1def \2_{copy}", source, flags=re.M)
            parts.append(renamed)
            total += len(renamed) + 1
            copy += 1
            if total >= size:
                break
    return "\n".join(parts)


def loaders(count: int) -> str:
    """A DDP script of ``count`` loaders, each with its own DistributedSampler."""
    head = (
        "import torch.distributed as dist\n"
        "from torch.utils.data import DataLoader, DistributedSampler\n"
        "from torchvision import datasets\n"
        "dist.init_process_group('nccl')\n"
        "data = datasets.MNIST('data')\n"
    )
    one = (
        "s{i} = DistributedSampler(data)\n"
        "loader{i} = DataLoader(data, batch_size=64, sampler=s{i})\n"
    )
    return head + "".join(one.format(i=i) for i in range(count)) + "x = data[0].cuda()\n"


def evaluations(count: int) -> str:
    """``count`` evaluation loaders, each handed to an evaluation function whose partial sum
    is printed (the rules that follow a loader into a function, and a returned sum back to
    its caller, once per loader)."""
    head = (
        "import torch.distributed as dist\n"
        "from torch.utils.data import DataLoader, DistributedSampler\n"
        "def evaluate(model, loader):\n    total = 0.0\n"
        "    for x in loader:\n        total += model(x).item()\n    return total\n"
        "dist.init_process_group('nccl')\n"
    )
    one = (
        "val_sampler{i} = DistributedSampler(val_set, shuffle=False)\n"
        "val_loader{i} = DataLoader(val_set, sampler=val_sampler{i})\n"
        "loss{i} = evaluate(model, val_loader{i})\n"
        "print(loss{i})\n"
    )
    return head + "".join(one.format(i=i) for i in range(count))


def measure(path: Path, repeats: int) -> tuple[float, float, int]:
    cpu, wall, findings = [], [], 0
    for _ in range(repeats):
        started_cpu, started_wall = time.process_time(), time.perf_counter()
        findings = len(diagnose(path).findings)
        cpu.append(time.process_time() - started_cpu)
        wall.append(time.perf_counter() - started_wall)
    return statistics.median(cpu), statistics.median(wall), findings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,100,200,1000,5000", help="KB, comma-separated")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--loaders", type=int, default=2000, help="loaders in one script")
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )
    print(f"{'size':>8} {'cpu s':>8} {'wall s':>8} {'findings':>9}")
    with tempfile.TemporaryDirectory() as folder:
        for kb in (int(s) for s in args.sizes.split(",")):
            path = Path(folder) / f"big{kb}.py"
            path.write_text(build(kb * 1000), encoding="utf-8")
            cpu, wall, findings = measure(path, args.repeats)
            print(f"{kb:>6}KB {cpu:>8.2f} {wall:>8.2f} {findings:>9}")
        many = Path(folder) / "loaders.py"
        many.write_text(loaders(args.loaders), encoding="utf-8")
        cpu, wall, findings = measure(many, args.repeats)
        size = many.stat().st_size // 1000
        print(
            f"{args.loaders} loaders ({size} KB): {cpu:.2f} s cpu, {wall:.2f} s wall, "
            f"{findings} findings"
        )
        evaluated = Path(folder) / "evaluations.py"
        evaluated.write_text(evaluations(args.loaders), encoding="utf-8")
        cpu, wall, findings = measure(evaluated, args.repeats)
        size = evaluated.stat().st_size // 1000
        print(
            f"{args.loaders} evaluation loaders ({size} KB): {cpu:.2f} s cpu, {wall:.2f} s "
            f"wall, {findings} findings"
        )
        deep = Path(folder) / "deep.py"
        deep.write_text("x = " + "+".join(["1"] * 200_000) + "\n", encoding="utf-8")
        started = time.process_time()
        try:
            diagnose(deep)
            outcome = "read (unexpected)"
        except UserError as exc:
            outcome = f"refused in one line: {str(exc)[:60]}..."
        print(f"200,000-term expression: {outcome} ({time.process_time() - started:.2f} s cpu)")


if __name__ == "__main__":
    main()
