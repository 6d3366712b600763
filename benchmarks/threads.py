"""paratrain's default CPU training on a quiet machine and beside a competing process.

    python benchmarks/threads.py [--steps 300] [--repeats 3] [--competitors 1]

Runs ``paratrain train --strategy cpu`` (digits) in fresh processes, with the threads
paratrain chooses (default: the free cores when the run starts), with ``--deterministic``
(every core, whatever the load), one thread, and every core with OpenMP's default wait
policy (torch's own default, what paratrain did before it chose), each without and with
``--competitors`` CPU-bound processes this script starts itself. The settings are
interleaved, repeat by repeat, so that a change in the machine's load touches them all
alike. Prints samples/s (median and range) and the contended/quiet ratio of each setting;
a run that takes longer than ``--timeout`` counts as that long (its figure is an upper
bound: torch's default beside a competing process can take minutes).

Acceptance: the default keeps >= 50% of its quiet throughput beside one competitor, and
its quiet throughput is within 10% of the best setting's.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: setting name -> (extra train arguments, environment changes; None removes a variable)
SETTINGS: dict[str, tuple[list[str], dict[str, str | None]]] = {
    "paratrain default": ([], {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None}),
    "--deterministic (the quiet count)": (
        ["--deterministic"],
        {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None},
    ),
    "OMP_NUM_THREADS=1": ([], {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": None}),
    "all cores, spinning (torch default)": (
        ["--threads", str(os.cpu_count() or 1)],
        {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None},
    ),
}
#: run as a script, not as the `paratrain` command (which sets OMP_WAIT_POLICY=PASSIVE)
SPINNING = {"all cores, spinning (torch default)"}
_AS_SCRIPT = "import sys; from paratrain.cli.main import main; sys.exit(main(sys.argv[1:]))"
_SPEED = re.compile(r"\(([\d,]+) samples/s\)")


def _spin() -> None:
    while True:
        pass


@contextmanager
def competitors(count: int) -> Iterator[None]:
    """``count`` processes that each keep one core busy, for as long as the block runs."""
    procs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(count)]
    for proc in procs:
        proc.start()
    time.sleep(0.5)  # running before training starts, as a job already there would be
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


def train_once(setting: str, steps: int, out: str, timeout: float) -> tuple[float, str]:
    """One training run in a fresh process; its samples/s (a run that takes longer than
    ``timeout`` counts as the samples it had to train over ``timeout``: an upper bound) and
    a digest of its final weights ("" when it timed out)."""
    extra, changes = SETTINGS[setting]
    env = dict(os.environ)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    start = ["-c", _AS_SCRIPT] if setting in SPINNING else ["-m", "paratrain"]
    command = [sys.executable, *start, "train", "--strategy", "cpu"]
    command += ["--max-steps", str(steps), "--out", out, "--overwrite", "--no-progress", *extra]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return steps * 32 / timeout, ""  # digits' batch of 32
    match = _SPEED.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"{setting}: training failed:\n{done.stderr[-2000:]}")
    weights = hashlib.sha256((Path(out) / "model.safetensors").read_bytes()).hexdigest()
    return float(match.group(1).replace(",", "")), weights


def main() -> None:
    # killed: the competitors are ended too (the finally of their block runs)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--competitors", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per run at most")
    args = parser.parse_args()
    print(
        f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start; "
        f"digits, {args.steps} steps, {args.repeats} repeats, interleaved"
    )
    figures: dict[tuple[str, bool], list[float]] = {}
    digests: dict[tuple[str, bool], set[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for contended in (False, True):
                for setting in SETTINGS:
                    if contended:
                        with competitors(args.competitors):
                            speed, digest = train_once(
                                setting, args.steps, f"{tmp}/run", args.timeout
                            )
                    else:
                        speed, digest = train_once(setting, args.steps, f"{tmp}/run", args.timeout)
                    digests.setdefault((setting, contended), set()).add(digest)
                    figures.setdefault((setting, contended), []).append(speed)
                    state = "contended" if contended else "quiet"
                    print(f"  repeat {repeat + 1}: {setting}, {state}: {speed:,.0f} samples/s")
    print(f"\n{'setting':38} {'quiet':>20} {'contended':>20} {'ratio':>6}")
    best_quiet = max(statistics.median(figures[(s, False)]) for s in SETTINGS)
    for setting in SETTINGS:
        quiet, busy = figures[(setting, False)], figures[(setting, True)]
        ratio = statistics.median(busy) / statistics.median(quiet)
        print(f"{setting:38} {_cell(quiet):>20} {_cell(busy):>20} {ratio:6.0%}")
    default_quiet = statistics.median(figures[("paratrain default", False)])
    print(
        f"\ndefault: {ratio_of(figures):.0%} of quiet throughput beside {args.competitors} "
        f"competitor(s) (goal >= 50%); quiet {default_quiet / best_quiet:.0%} of the best "
        "setting's (goal >= 90%)"
    )
    # which runs ended with the same weights: a letter per distinct final weights
    names: dict[str, str] = {}
    for (setting, contended), seen in digests.items():
        letters = "".join(
            sorted(names.setdefault(d, "ABCDEFGHIJ"[len(names) % 10]) for d in seen if d)
        )
        state = "contended" if contended else "quiet"
        print(f"weights {letters or '-':4} {setting}, {state}")


def ratio_of(figures: dict[tuple[str, bool], list[float]]) -> float:
    quiet = statistics.median(figures[("paratrain default", False)])
    return statistics.median(figures[("paratrain default", True)]) / quiet


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


if __name__ == "__main__":
    main()
