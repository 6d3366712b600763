"""Kill a run while it saves a checkpoint, resume it, compare: N times.

    python benchmarks/faults.py                    # 5 kills, --strategy ddp on 2 CPU processes
    python benchmarks/faults.py --kills 15 --strategy cpu

Trains a reference run of the digits recipe once. Then, N times: starts the same run, waits
until a checkpoint is being written (its hidden ``.step-N.tmp`` folder exists; saves are held
open for a moment by ``PARATRAIN_TEST_STALL_SAVE``, read by the test suite's fault injection
plug-in in ``tests/plugins``), at a different save each time, and
kills the launcher with SIGKILL. It counts the ranks still alive a few seconds later
(orphans), resumes with ``--resume`` (which takes over the dead launcher's lock) and compares
the final weights and ``metrics.jsonl`` with the reference, byte for byte. While the first run
trains it lists every TCP socket its processes listen on (from /proc/net/tcp and tcp6) and
how many of them are reachable from other machines (not on loopback). Linux only.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from processes import alive, descendants, exposed, listening

from paratrain.devices.machine import cpu_name


def _env(stall: float | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARATRAIN_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # the suite's plug-in, which injects the stall (docs/development.md, "Fault injection")
    plugins = Path(__file__).resolve().parent.parent / "tests" / "plugins"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugins), env.get("PYTHONPATH")]))
    if stall is not None:
        env["PARATRAIN_TEST_STALL_SAVE"] = str(stall)
    return env


def _train(args: list[str], stall: float | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "paratrain", "train", "--no-progress", *args],
        env=_env(stall),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _same(a: Path, b: Path) -> bool:
    names = ("model.safetensors", "metrics.jsonl")
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def _saving(run: Path) -> bool:
    root = run / "checkpoints"
    return root.is_dir() and any(p.name.endswith(".tmp") for p in root.iterdir())


def _saves_done(run: Path) -> int:
    root = run / "checkpoints"
    return sum(1 for p in root.iterdir() if p.name.startswith("step-")) if root.is_dir() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", default="cpu,cpu")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=8)
    args = parser.parse_args()
    common = ["--recipe", "digits", "--strategy", args.strategy, "--epochs", str(args.epochs)]
    common += ["--save-every", str(args.save_every), "--keep", "100"]
    if args.strategy not in ("cpu", "auto"):
        common += ["--devices", args.devices]
    work = Path(tempfile.mkdtemp(prefix="paratrain-faults-"))
    try:
        reference = work / "reference"
        if _train([*common, "--out", str(reference)]).wait() != 0:
            raise SystemExit("the reference run failed")
        kills = resumed = identical = orphans = 0
        listeners: list[tuple[str, int]] = []
        for trial in range(args.kills):
            run = work / f"run-{trial}"
            launcher = _train([*common, "--out", str(run)], stall=0.3)
            target = 1 + trial % 3  # kill during the 2nd, 3rd or 4th save
            while launcher.poll() is None and not (_saving(run) and _saves_done(run) >= target):
                time.sleep(0.02)
            if launcher.poll() is not None:
                print(f"trial {trial}: the run ended before it was killed")
                continue
            ranks = descendants(launcher.pid)
            if trial == 0:
                listeners = listening([launcher.pid, *ranks])
            launcher.send_signal(signal.SIGKILL)
            launcher.wait()
            kills += 1
            time.sleep(5.0)  # "a few seconds": what is still alive then is an orphan
            left = [pid for pid in ranks if alive(pid)]
            orphans += len(left)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            again = _train(["--resume", str(run)])
            _, err = again.communicate()
            if again.returncode != 0:
                print(f"trial {trial}: resume failed: {err.decode().strip()[-300:]}")
                continue
            resumed += 1
            identical += _same(reference, run)
            shutil.rmtree(run, ignore_errors=True)
        print(f"machine: {cpu_name()}, {os.cpu_count()} cores; {platform.platform()}")
        print(f"torch {torch.__version__}, python {platform.python_version()}")
        print(
            f"run: digits, --strategy {args.strategy}, {args.epochs} epochs, save every "
            f"{args.save_every} steps; killed with SIGKILL during a checkpoint save"
        )
        print(
            f"kills: {kills}; resumed: {resumed}; bit-identical to the reference: {identical}; "
            f"ranks alive 5 s after their launcher was killed: {orphans}"
        )
        shown = ", ".join(f"{a}:{p}" for a, p in listeners) or "none"
        print(
            f"listeners of the first run: {len(listeners)} ({shown}); "
            f"reachable beyond loopback: {len(exposed(listeners))}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
