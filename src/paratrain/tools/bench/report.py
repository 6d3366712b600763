"""The bench's outputs: a table in the terminal and ``bench.json`` (the chart: chart.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from paratrain.devices.machine import machine_info
from paratrain.tools.bench.memory import memory_bars
from paratrain.tools.bench.results import BenchReport, RunResult
from paratrain.tools.bench.stats import spread
from paratrain.training import rundir
from paratrain.utils.atomic import atomic_write_text
from paratrain.utils.errors import UserError

BENCH_JSON = "bench.json"
BENCH_PNG = "bench.png"
SCHEMA_VERSION = 1


def check_out(out: Path, overwrite: bool) -> Path:
    """Refuse, before anything runs, to replace a bench.json already in ``out``."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory; choose another --out")
    if (out / BENCH_JSON).exists() and not overwrite:
        raise UserError(
            f"--out {out} already holds {BENCH_JSON}; pass --overwrite to replace it "
            "or choose another --out"
        )
    return out


def make_out(out: Path) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {out}: {exc.strerror}") from None
    return out


def format_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return (
                f"{value / size:.1f} {unit}" if value < 100 * size else f"{value / size:.0f} {unit}"
            )
    return f"{value} B"


def _memory_cell(result: RunResult) -> str:
    bars = memory_bars(result.memory)
    if len(bars) == 1:
        return format_bytes(bars[0][1])
    return "\n".join(f"{name.removesuffix(' RSS')} {format_bytes(value)}" for name, value in bars)


def _predicted_cell(result: RunResult) -> str:
    predicted = result.predicted_peak_bytes
    if not predicted:
        return "-"
    if len(set(predicted)) == 1:
        return format_bytes(predicted[0])
    return "\n".join(f"{i} {format_bytes(value)}" for i, value in enumerate(predicted))


def _state_bytes(result: RunResult) -> int | None:
    """The most parameter + gradient + optimizer-state bytes any one process held."""
    held = [b for b in (result.memory or {}).get("state_bytes", []) if b is not None]
    return max(held) if held else None


def result_dict(result: RunResult) -> dict[str, Any]:
    sps = result.samples_per_second()
    steps = result.step_seconds()
    data: dict[str, Any] = {
        "label": result.combo.label,
        "combination": result.combo.to_dict(),
        "status": result.status,
        "reason": result.reason,
        "config": result.spec,
        "samples_per_second": ({**spread(sps).to_dict(), "repeats": sps} if sps else None),
        "step_seconds": spread(steps).to_dict() if steps else None,
        "timed_window_seconds": {"first": result.seconds, "retimed": result.retimed_seconds},
        "memory": result.memory,
        "predicted_peak_bytes": result.predicted_peak_bytes,
        "gathered_bytes_per_step": result.gathered_bytes_per_step,
        "runtime": result.runtime,
        "runs": result.runs,
        "stopped_early": result.stopped_early,
    }
    if result.traceback:
        data["traceback"] = result.traceback
    return data


def report_dict(report: BenchReport) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "arguments": report.arguments,
        "started_at": report.started_at,
        "finished_at": report.finished_at,
        "wall_seconds": report.wall_seconds,
        "machine": machine_info().to_dict(),
        "versions": rundir.versions(),
        "settings": report.settings.to_dict(),
        "task": {"name": report.settings.source.name, "train_samples": report.train_samples},
        "results": [result_dict(r) for r in report.results],
        "recommendation": report.recommendation.to_dict(),
        "load": report.load.to_dict(),
        "remarks": list(report.remarks),
    }


def write_json(report: BenchReport, out: Path) -> Path:
    path = out / BENCH_JSON
    atomic_write_text(path, json.dumps(report_dict(report), indent=2) + "\n")
    return path


def build_table(report: BenchReport) -> Table:
    """The measured combinations; the skipped ones and failures are listed below it."""
    winner = report.recommendation.winner
    table = Table(title=f"paratrain bench: {report.settings.source.name}", title_justify="left")
    table.add_column("combination", no_wrap=True)
    table.add_column("status")
    table.add_column("samples/s", justify="right")
    table.add_column("min-max", justify="right")
    table.add_column("ms/step", justify="right")
    table.add_column("peak memory", justify="right")
    table.add_column("predicted", justify="right")
    table.add_column("state/proc", justify="right")
    table.add_column("gathered", justify="right")
    for result in report.results:
        if result.status == "skipped":
            continue
        sps = result.samples_per_second()
        # from the median throughput, so the two columns describe the same window
        step_ms = 1000 * result.samples_per_step / spread(sps).median if sps else None
        mark = "* " if result.combo.label == winner else ""
        table.add_row(
            f"{mark}{result.combo.label}",
            result.status + (" (stopped early)" if result.stopped_early else ""),
            f"{spread(sps).median:,.0f}" if sps else "-",
            f"{min(sps):,.0f}-{max(sps):,.0f}" if sps else "-",
            "-" if step_ms is None else f"{step_ms:.2f}",
            _memory_cell(result),
            _predicted_cell(result),
            format_bytes(_state_bytes(result)),
            format_bytes(result.gathered_bytes_per_step),
            style="red" if result.status != "ok" else None,
        )
    return table


def notes(report: BenchReport) -> list[str]:
    """How the bench ran where it differs from what was asked, then why combinations were
    skipped or failed, one line each (same reasons grouped)."""
    lines = list(report.remarks)
    skipped: dict[str, list[str]] = {}
    for result in report.results:
        if result.status == "skipped":
            skipped.setdefault(result.reason or "", []).append(result.combo.label)
        elif result.status != "ok":
            lines.append(f"{result.status}: {result.combo.label}: {result.reason}")
    for reason, labels in skipped.items():
        lines.append(f"skipped: {', '.join(labels)}: {reason}")
    return lines


def print_report(report: BenchReport, console: Console) -> None:
    console.print(build_table(report))
    console.print(
        "samples/s: median over the timed windows (min-max), interleaved round by round with "
        "the other combinations' (on the CPU from two worker processes taking turns); "
        "stopped early: slower in every window than the leader in "
        "any, so not timed further; memory: peak per GPU, else peak RSS per process; "
        "predicted: paratrain plan's peak per device (tensors only: a CPU process's RSS also "
        "holds Python, torch and the data); state/proc: parameters + gradients + optimizer "
        "state of one process (fsdp: its shards); gathered: bytes brought to the first device "
        "per step; ac: with --activation-checkpointing; tN: with --threads N",
        style="dim",
    )
    for line in notes(report):
        console.print(line, markup=False, highlight=False)
    console.print(report.load.sentence(), markup=False, highlight=False)
    console.print(f"[bold]recommendation:[/bold] {report.recommendation.message}")
