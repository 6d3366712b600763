"""Run every combination, each in a fresh process, then time the top two again."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paratrain.bench.combos import Combo, enumerate_combos, with_activation_checkpointing
from paratrain.bench.noise import MachineLoad, cores, gpu_processes, load_average, load_sample
from paratrain.bench.recommend import Candidate, Recommendation, recommend
from paratrain.bench.stats import spread, throughputs
from paratrain.bench.task import TaskSource, check_task
from paratrain.bench.worker import WORKER_CODE, RunSpec, collect


@dataclass
class BenchSettings:
    source: TaskSource
    strategies: list[str] | None = None
    precisions: list[str] | None = None
    batch_sizes: list[int] | None = None
    devices: str | None = None
    steps: int = 30
    warmup: int = 5
    repeats: int = 3
    seed: int = 0
    timeout: float = 600.0
    retime: bool = True
    #: also measure each combination with activation checkpointing
    activation_checkpointing: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": asdict(self.source),
            "strategies": self.strategies,
            "precisions": self.precisions,
            "batch_sizes": self.batch_sizes,
            "devices": self.devices,
            "steps": self.steps,
            "warmup": self.warmup,
            "repeats": self.repeats,
            "seed": self.seed,
            "timeout": self.timeout,
            "retime": self.retime,
            "activation_checkpointing": self.activation_checkpointing,
        }


@dataclass
class RunResult:
    """One combination: its configuration, what happened, and every measurement."""

    combo: Combo
    status: str  # ok | oom | error | skipped
    reason: str | None = None
    spec: dict[str, Any] | None = None
    seconds: list[float] = field(default_factory=list)
    retimed_seconds: list[float] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    gathered_bytes_per_step: int | None = None
    runtime: dict[str, Any] | None = None
    traceback: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)  # start/end of each process run
    #: ``paratrain plan``'s peak per device for this combination (None: not planned)
    predicted_peak_bytes: list[int] | None = None

    @property
    def samples_per_step(self) -> int:
        return self.combo.batch_size

    def samples_per_second(self) -> list[float]:
        """Throughput of every timed window, first run and re-timing together."""
        steps = int(self.spec["steps"]) if self.spec else 0
        windows = self.seconds + self.retimed_seconds
        return throughputs(windows, steps * self.samples_per_step)

    def step_seconds(self) -> list[float]:
        steps = int(self.spec["steps"]) if self.spec else 1
        return [s / steps for s in self.seconds + self.retimed_seconds]

    def candidate(self) -> Candidate:
        return Candidate(self.combo.label, self.status, self.samples_per_second())


@dataclass
class BenchReport:
    settings: BenchSettings
    results: list[RunResult]
    recommendation: Recommendation
    started_at: str
    finished_at: str
    wall_seconds: float
    train_samples: int
    arguments: dict[str, Any] = field(default_factory=dict)  # the command line, parsed
    #: other work on the machine, looked at between runs
    load: MachineLoad = field(default_factory=lambda: MachineLoad(cores()))


_LAUNCHER_VARIABLES = frozenset(
    (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
)

#: called with (what is running now, how many runs are done, how many in all)
ProgressFn = Callable[[str, int, int], None]


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def run_worker(spec: RunSpec, processes: int, timeout: float) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter (which starts its own process group if needed)."""
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec.to_dict()), encoding="utf-8")
        out_dir = Path(tmp) / "out"
        out_dir.mkdir()
        started, begin = _now(), time.perf_counter()
        command = [sys.executable, "-c", WORKER_CODE, str(spec_path), str(out_dir)]
        # A bench started inside a launched group must not make its workers think they are
        # ranks of that group.
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
        # set before the worker imports torch; its runtime chooses the thread count
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # A session of its own: on a timeout the whole group (launched ranks too) is ended.
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        timed_out = False
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            _, stderr = proc.communicate()
        except BaseException:  # Ctrl-C reaches only our group: end the worker's too
            _kill_group(proc)
            proc.wait()
            raise
        result = collect(out_dir, processes)
        if timed_out:
            result.update(status="error", reason=f"timed out after {timeout:.0f}s")
        elif result["status"] == "error" and not result.get("reason"):
            tail = [line for line in (stderr or "").strip().splitlines() if line.strip()]
            result["reason"] = tail[-1][:300] if tail else f"worker exited with {proc.returncode}"
        result["run"] = {
            "started_at": started,
            "finished_at": _now(),
            "wall_seconds": time.perf_counter() - begin,
            "returncode": proc.returncode,
        }
        return result


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """End the worker and every process it started (they share its session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _spec(settings: BenchSettings, combo: Combo) -> RunSpec:
    return RunSpec(
        source=settings.source,
        strategy=combo.strategy,
        devices=combo.devices,
        precision=combo.precision,
        batch_size=combo.batch_size,
        steps=settings.steps,
        warmup=settings.warmup,
        repeats=settings.repeats,
        seed=settings.seed,
        activation_checkpointing=combo.activation_checkpointing,
    )


def _apply(result: RunResult, outcome: dict[str, Any], retime: bool) -> None:
    result.runs.append(outcome["run"])
    if retime:
        if outcome["status"] == "ok":
            result.retimed_seconds = list(outcome["seconds"])
        return
    result.status = outcome["status"]
    result.reason = outcome.get("reason")
    result.memory = outcome.get("memory", {})
    result.traceback = outcome.get("traceback")
    if outcome["status"] == "ok":
        result.seconds = list(outcome["seconds"])
        result.gathered_bytes_per_step = outcome.get("gathered_bytes_per_step")
        result.runtime = outcome.get("runtime")


def top_two(results: list[RunResult]) -> list[RunResult]:
    ok = [r for r in results if r.status == "ok" and r.samples_per_second()]
    ok.sort(key=lambda r: spread(r.samples_per_second()).median, reverse=True)
    return ok[:2]


def run_bench(settings: BenchSettings, progress: ProgressFn | None = None) -> BenchReport:
    """Measure every combination; the top two are timed again before recommending."""
    started_at, begin = _now(), time.perf_counter()
    train_samples, batch_sizes = check_task(settings.source, settings.batch_sizes)
    combos = enumerate_combos(
        settings.strategies, settings.precisions, batch_sizes, settings.devices
    )
    if settings.activation_checkpointing:
        combos = with_activation_checkpointing(combos)
    results = [
        RunResult(c, "skipped", c.skip_reason) if c.skip_reason else RunResult(c, "pending")
        for c in combos
    ]
    pending = [r for r in results if r.status == "pending"]
    averages, busy = [load_average()], [load_sample()]  # before any worker: others' work
    # Two re-timings are expected; fewer happen when fewer than two runs succeed.
    total, done = len(pending) + (2 if settings.retime and len(pending) > 1 else 0), 0
    for result in pending:
        if progress is not None:
            progress(result.combo.label, done, total)
        spec = _spec(settings, result.combo)
        result.spec = spec.to_dict()
        _apply(result, run_worker(spec, result.combo.processes, settings.timeout), False)
        busy.append(load_sample())  # between runs: none of the bench's processes run
        done += 1
    leaders = top_two(results) if settings.retime else []
    if len(leaders) == 2:
        for result in leaders:
            if progress is not None:
                progress(f"{result.combo.label} (again)", done, total)
            spec = _spec(settings, result.combo)
            _apply(result, run_worker(spec, result.combo.processes, settings.timeout), True)
            busy.append(load_sample())
            done += 1
    if progress is not None:
        progress("done", done, done)
    averages.append(load_average())
    load = MachineLoad(cores(), tuple(busy), tuple(averages), gpu_processes([os.getpid()]))
    return BenchReport(
        settings=settings,
        results=results,
        recommendation=recommend([r.candidate() for r in results], load.is_busy),
        load=load,
        started_at=started_at,
        finished_at=_now(),
        wall_seconds=time.perf_counter() - begin,
        train_samples=train_samples,
    )
