"""How long paratrain takes to start: ``import torch``, ``import paratrain`` (alone, and
with the public names a script uses), ``paratrain --help`` and every ``paratrain <cmd>
--help``, each in a fresh interpreter.

    python benchmarks/startup.py [--repeats 5]

Prints the median and range of the wall time of each, the median CPU time (user + system,
less sensitive to a busy machine than the wall time) and the load average. The commands
are interleaved, repeat by repeat, so that a change in the machine's load touches them all
alike.

Acceptance: ``import paratrain`` with its public names <= ``import torch`` + 0.3 s;
``paratrain --help`` and each ``paratrain <cmd> --help`` <= 1 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from paratrain.cli.commands import COMMAND_MODULES

_HELP = "from paratrain.cli.main import main; main({argv!r})"

#: label -> the Python code a fresh interpreter runs
CASES = {
    "import torch": "import torch",
    "import paratrain": "import paratrain",
    "import paratrain + public names": (
        "import paratrain\nfor name in paratrain.__all__: getattr(paratrain, name)"
    ),
    "paratrain --help": _HELP.format(argv=["--help"]),
    **{f"paratrain {name} --help": _HELP.format(argv=[name, "--help"]) for name in COMMAND_MODULES},
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def seconds(code: str) -> tuple[float, float]:
    """Wall and CPU time of ``python -c code`` in a fresh interpreter."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cpu = _children_cpu()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start, _children_cpu() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each (5)")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    times: dict[str, list[float]] = {label: [] for label in CASES}
    cpu: dict[str, list[float]] = {label: [] for label in CASES}
    for _ in range(args.repeats):
        for label, code in CASES.items():
            wall, used = seconds(code)
            times[label].append(wall)
            cpu[label].append(used)
    torch_median = statistics.median(times["import torch"])
    print(f"{'':34s} {'wall median [range]':>22s}  cpu")
    for label, measured in times.items():
        median = statistics.median(measured)
        used = statistics.median(cpu[label])
        extra = f"  (import torch {median - torch_median:+.2f} s)" if "names" in label else ""
        print(
            f"{label:34s} {median:6.2f} s [{min(measured):.2f}-{max(measured):.2f}]"
            f"  {used:.2f} s{extra}"
        )
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
