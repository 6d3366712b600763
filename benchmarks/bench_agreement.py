"""Does `paratrain bench` agree with itself? The default bench, several times in a row.

    python benchmarks/bench_agreement.py [--runs 3] [-- BENCH OPTIONS...]

Runs ``paratrain bench`` (default settings, or the options after ``--``) ``--runs`` times
one after the other and prints, per combination, its median samples/s in each run and how
far the runs are apart ((max - min) / min of the medians), then each run's duration, load
and recommendation. Acceptance on a quiet 2-core machine: every combination within 10%,
the same recommendation every run, each run at most 60 s. Run it on a quiet machine: the
bench says when it was not (``load`` below), and then the spread says nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: acceptance
AGREEMENT = 0.10
DURATION_SECONDS = 60.0


def bench_once(out: Path, options: list[str]) -> tuple[dict[str, Any], float]:
    """One default bench in a fresh process: its bench.json and its wall time."""
    command = [sys.executable, "-m", "paratrain", "bench", "--no-plot", "--no-progress"]
    command += ["--json", "--overwrite", "--out", str(out), *options]
    begin = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - begin
    if done.returncode != 0:
        raise SystemExit(f"paratrain bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((out / "bench.json").read_text(encoding="utf-8")), seconds


def medians(report: dict[str, Any]) -> dict[str, float | None]:
    """Combination label -> its median samples/s (None: did not run to completion)."""
    found: dict[str, float | None] = {}
    for result in report["results"]:
        if result["status"] == "skipped":
            continue
        throughput = result.get("samples_per_second") or {}
        found[result["label"]] = throughput.get("median") if result["status"] == "ok" else None
    return found


def recommendation(report: dict[str, Any]) -> str:
    rec = report["recommendation"]
    if rec.get("tie"):
        return f"tie: {rec['winner']} / {rec['runner_up']}"
    return str(rec.get("winner"))


def _uptime() -> str:
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="keep each run's bench.json under this folder")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="-- then bench options")
    args = parser.parse_args()
    options = [o for o in args.options if o != "--"]
    print(f"# {os.cpu_count()} cores, {_uptime()} at the start; bench {' '.join(options)}")
    reports: list[dict[str, Any]] = []
    durations: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            report, seconds = bench_once((args.keep or Path(tmp)) / f"run{run}", options)
            reports.append(report)
            durations.append(seconds)
            print(f"  run {run + 1}: {seconds:.1f}s, {recommendation(report)}", flush=True)
    per_run = [medians(r) for r in reports]
    labels = list(dict.fromkeys(label for m in per_run for label in m))
    heads = "".join(f"{'run ' + str(i + 1):>11}" for i in range(args.runs))
    print(f"\n{'combination':22}{heads}{'spread':>9}  windows")
    worst = 0.0
    for label in labels:
        values = [m.get(label) for m in per_run]
        cells = "".join(f"{v:>11,.0f}" if v else f"{'-':>11}" for v in values)
        measured = [v for v in values if v]
        gap = (max(measured) - min(measured)) / min(measured) if len(measured) > 1 else 0.0
        worst = max(worst, gap)
        windows = [_windows(r, label) for r in reports]
        print(f"{label:22}{cells}{gap:>9.1%}  {'/'.join(windows)}")
    print(f"\n{'':22}" + "".join(f"{s:>10.1f}s" for s in durations) + "  duration")
    for i, report in enumerate(reports):
        load = report.get("load", {})
        print(
            f"run {i + 1}: {recommendation(report)}; busy cores (median) "
            f"{load.get('busy_median', float('nan')):.1f}, load average "
            f"{', '.join(f'{a:.1f}' for a in load.get('load_average', []))}"
        )
    same = len({recommendation(r) for r in reports}) == 1
    print(
        f"\nagreement: widest spread {worst:.1%} (goal <= {AGREEMENT:.0%}); same recommendation "
        f"every run: {'yes' if same else 'no'}; longest run {max(durations):.1f}s (goal <= "
        f"{DURATION_SECONDS:.0f}s); {_uptime()} at the end"
    )


def _windows(report: dict[str, Any], label: str) -> str:
    for result in report["results"]:
        if result["label"] == label:
            count = len(result.get("timed_window_seconds", {}).get("first", []))
            return f"{count}{'s' if result.get('stopped_early') else ''}"
    return "-"


if __name__ == "__main__":
    main()
