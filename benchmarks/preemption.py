"""How long a run takes to stop on SIGTERM, and what asking every step costs.

    python benchmarks/preemption.py [--repeats 3] [--recipe digits]

For ``--strategy cpu``, ``ddp`` and ``fsdp`` on ``cpu,cpu``: starts ``paratrain train``,
sends SIGTERM to it once its first checkpoint exists, and times the signal to the exit of
the command (every process gone), next to what the stop line says (signal to checkpoint
complete). Then the cost of ``rt.should_stop()`` per optimizer step: one all-reduce of two
float64 numbers between two gloo processes, in microseconds. Prints median and spread, and
the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import paratrain
from paratrain.launching import preemption

LAYOUTS = {
    "cpu": ["--strategy", "cpu"],
    "ddp x2": ["--strategy", "ddp", "--devices", "cpu,cpu"],
    "fsdp x2": ["--strategy", "fsdp", "--devices", "cpu,cpu"],
}


def stop_once(recipe: str, layout: list[str], folder: Path) -> tuple[float, float]:
    """(signal to exit, signal to checkpoint complete as the line says), in seconds."""
    out = folder / f"run-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "paratrain", "train", "--recipe", recipe, *layout]
    argv += ["--epochs", "50", "--save-every", "2", "--no-progress", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    while not (out / "checkpoints").is_dir():
        if process.poll() is not None:
            raise SystemExit(
                f"the run ended early: {process.stderr.read() if process.stderr else ''}"
            )
        time.sleep(0.05)
    sent = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    exited = time.perf_counter() - sent
    found = re.search(r", ([\d.]+)s after the signal", err)
    if process.returncode != 143 or found is None:
        raise SystemExit(f"unexpected end (exit code {process.returncode}):\n{err[-2000:]}")
    return exited, float(found.group(1))


def _agree_cost(rt: paratrain.Runtime, calls: int) -> float:
    """Microseconds per rt.should_stop() (rank 0's view)."""
    rt.barrier()
    for _ in range(50):
        preemption.agree(rt.strategy.collective)
    start = time.perf_counter()
    for _ in range(calls):
        rt.should_stop()
    return (time.perf_counter() - start) / calls * 1e6


def summary(values: list[float], unit: str, scale: float = 1.0) -> str:
    middle = statistics.median(values) * scale
    return (
        f"median {middle:.3g}{unit} (min {min(values) * scale:.3g}, max {max(values) * scale:.3g})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--recipe", default="digits")
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, paratrain {paratrain.__version__}; recipe {args.recipe}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in LAYOUTS.items():
            runs = [stop_once(args.recipe, layout, Path(tmp)) for _ in range(args.repeats)]
            exits, saves = [r[0] for r in runs], [r[1] for r in runs]
            print(
                f"{name:8s} SIGTERM to exit: {summary(exits, ' s')}; "
                f"to checkpoint complete (its line): {summary(saves, ' s')}"
            )
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu")
    costs = rt.launch(_agree_cost, 2000)
    print(f"rt.should_stop() with 2 gloo processes: {costs:.1f} us per optimizer step")


if __name__ == "__main__":
    main()
