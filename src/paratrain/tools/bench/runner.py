"""Run every combination, each in a fresh worker process that stays for all its windows;
the windows are interleaved, combination by combination, round by round."""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from paratrain.launching.threads import choose_for
from paratrain.tools.bench.combos import (
    Combo,
    enumerate_combos,
    with_activation_checkpointing,
    with_thread_counts,
)
from paratrain.tools.bench.noise import (
    MachineLoad,
    clear_losers,
    compare,
    cores,
    gpu_processes,
    load_average,
    load_sample,
)
from paratrain.tools.bench.process import WorkerProcess
from paratrain.tools.bench.recommend import Candidate, Recommendation, recommend
from paratrain.tools.bench.stats import spread, throughputs
from paratrain.tools.bench.task import TaskSource, check_task
from paratrain.tools.bench.worker import RunSpec
from paratrain.utils.peak_memory import available_host_bytes


@dataclass
class BenchSettings:
    source: TaskSource
    strategies: list[str] | None = None
    precisions: list[str] | None = None
    batch_sizes: list[int] | None = None
    devices: str | None = None
    steps: int = 100
    warmup: int = 5
    repeats: int = 5
    seed: int = 0
    timeout: float = 600.0
    #: two leaders within noise of each other get EXTRA_WINDOWS more windows each
    retime: bool = True
    #: also measure each combination with activation checkpointing
    activation_checkpointing: bool = False
    #: intra-op thread counts per process to measure on CPU layouts (None: combos.py's)
    threads: list[int] | None = None
    #: fresh worker processes per combination, its rounds alternating between them (None:
    #: CPU_INSTANCES on the CPU, one where a GPU's memory would hold them all at once)
    instances: int | None = None

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
            "threads": self.threads,
            "instances": self.instances,
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
    #: a clear loser (bench.noise.clear_losers): not timed after its first windows
    stopped_early: bool = False
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
    #: how the bench ran where it differs from what was asked (one line each)
    remarks: list[str] = field(default_factory=list)


#: called with (what is running now, how many steps of the bench are done, how many in all)
ProgressFn = Callable[[str, int, int], None]
#: a clear loser is stopped after this many windows at the earliest (and never before half
#: of its windows: its figure stays a median of several, from each of its processes)
EARLIEST_STOP = 4
#: windows added for the two leaders when their first ones are within noise of each other
EXTRA_WINDOWS = 2
#: worker processes per CPU combination: a process's luck (where its memory landed, how its
#: threads were placed) moves all of its windows alike, by up to 5-8% on a 2-core machine;
#: two processes, whose rounds alternate, halve what one such draw can do to the figure
CPU_INSTANCES = 2


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def chosen_threads(processes: int) -> int:
    """The count paratrain chooses for each of ``processes`` processes, as ``train`` would
    here: the load it follows is the one the bench command saw when it started, before its
    workers loaded the machine."""
    return choose_for(processes).threads


def _spec(
    settings: BenchSettings, combo: Combo, chosen: Callable[[int], int] = chosen_threads
) -> RunSpec:
    threads = combo.threads if combo.threads is not None else chosen(combo.processes)
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
        threads=threads,
    )


#: more worker processes per combination only where they take at most this share of the
#: host memory still available (every worker stays alive for the whole bench)
HOST_SHARE = 0.5


def memory_short(before: int | None, after: int | None, started: int, more: int) -> str | None:
    """Why ``more`` workers would not fit, judged from what ``started`` ones took of the
    host's available memory (``before`` and ``after`` they started); None: they fit, or
    the host does not say."""
    if before is None or after is None or started < 1:
        return None
    needed = max(0, before - after) / started * more
    if needed <= HOST_SHARE * after:
        return None
    return (
        f"{more} more would need about {needed / 2**30:.1f} GiB of the "
        f"{after / 2**30:.1f} GiB the host has available"
    )


def instances_of(settings: BenchSettings, combo: Combo) -> int:
    if settings.instances is not None:
        return settings.instances
    return CPU_INSTANCES if combo.on_cpu else 1


def _apply(result: RunResult, outcomes: list[dict[str, Any]]) -> None:
    """The outcomes of a combination's worker processes: the first that did not end well
    decides its status. Its windows are the runner's own list, in the order they were timed."""
    result.runs.extend(outcome["run"] for outcome in outcomes)
    failed = [o for o in outcomes if o["status"] != "ok"]
    outcome = failed[0] if failed else outcomes[0]
    result.status = outcome["status"]
    result.reason = outcome.get("reason")
    result.memory = outcome.get("memory", {})
    result.traceback = outcome.get("traceback")
    if result.status == "ok":
        result.gathered_bytes_per_step = outcome.get("gathered_bytes_per_step")
        result.runtime = outcome.get("runtime")
        if not result.seconds:
            result.status, result.reason = "error", "no window was timed"


def _speeds(result: RunResult, steps: int) -> list[float]:
    return throughputs(result.seconds, steps * result.combo.batch_size)


class _Session:
    """The workers of one bench and the progress count."""

    def __init__(
        self,
        settings: BenchSettings,
        progress: ProgressFn | None,
        total: int,
        chosen: Callable[[int], int],
    ):
        self.settings, self.progress, self.total, self.done = settings, progress, total, 0
        self.chosen = chosen
        #: each combination's worker processes; its windows take turns among them
        self.workers: dict[int, list[WorkerProcess]] = {}
        #: what the report should say about how the bench ran
        self.remarks: list[str] = []

    def say(self, what: str) -> None:
        if self.progress is not None:
            self.progress(what, self.done, self.total)

    def start(self, results: list[RunResult]) -> list[RunResult]:
        """Start every worker: each combination's first, then its others where the host's
        memory holds them; the combinations whose workers all got ready, in order."""
        before = available_host_bytes()
        failed = self._start([(r, 0) for r in results])
        most = max((instances_of(self.settings, r.combo) for r in results), default=1)
        more = [
            (result, instance)
            for instance in range(1, most)
            for result in results
            if instance < instances_of(self.settings, result.combo) and id(result) not in failed
        ]
        if more:
            short = memory_short(before, available_host_bytes(), len(results), len(more))
            if short is not None:
                self.remarks.append(f"one worker process per combination: {short}")
                more = []
        failed |= self._start(more)
        return [r for r in results if id(r) not in failed]

    def _start(self, starts: list[tuple[RunResult, int]]) -> set[int]:
        """Start these (combination, instance) workers, as many at a time as there are cores
        (starting is CPU work: importing torch, building, warming up); the ids of the
        combinations whose worker did not get ready."""
        failed: set[int] = set()
        at_once = max(1, cores())
        for first in range(0, len(starts), at_once):
            group = starts[first : first + at_once]
            for result, _ in group:
                spec = _spec(self.settings, result.combo, self.chosen)
                result.spec = spec.to_dict()
                worker = WorkerProcess(spec, result.combo.processes, self.settings.timeout)
                self.workers.setdefault(id(result), []).append(worker)
            for result, instance in group:
                self.say(f"starting {result.combo.label}")
                if not self.workers[id(result)][instance].wait_ready():
                    failed.add(id(result))
            self.done += sum(1 for _, instance in group if instance == 0)
        return failed

    def window(self, result: RunResult, label: str) -> bool:
        self.say(label)
        workers = self.workers[id(result)]
        seconds = workers[len(result.seconds) % len(workers)].window()
        self.done += 1
        if seconds is None:
            return False
        result.seconds.append(seconds)
        return True

    def finish(self, results: list[RunResult]) -> None:
        for workers in self.workers.values():
            for worker in workers:
                worker.ask_stop()
        for result in results:
            outcomes = [worker.finish() for worker in self.workers.pop(id(result), [])]
            if outcomes:
                _apply(result, outcomes)

    def kill(self) -> None:
        for workers in self.workers.values():
            for worker in workers:
                worker.kill()


def run_bench(settings: BenchSettings, progress: ProgressFn | None = None) -> BenchReport:
    """Measure every combination: one worker process each, its windows interleaved with
    the others' round by round; clear losers stop early, and two leaders within noise of
    each other get ``EXTRA_WINDOWS`` more each before recommending."""
    started_at, begin = _now(), time.perf_counter()
    train_samples, batch_sizes = check_task(settings.source, settings.batch_sizes)
    combos = enumerate_combos(
        settings.strategies, settings.precisions, batch_sizes, settings.devices
    )
    # chosen once, before any worker loads the machine (and the same for every combination)
    counts = {c.processes: chosen_threads(c.processes) for c in combos}
    combos = with_thread_counts(combos, settings.threads, counts.__getitem__)
    if settings.activation_checkpointing:
        combos = with_activation_checkpointing(combos)
    results = [
        RunResult(c, "skipped", c.skip_reason) if c.skip_reason else RunResult(c, "pending")
        for c in combos
    ]
    pending = [r for r in results if r.status == "pending"]
    averages, busy = [load_average()], [load_sample()]  # before any worker: others' work
    session = _Session(
        settings, progress, len(pending) * (1 + settings.repeats), counts.__getitem__
    )
    try:
        alive = session.start(pending)
        busy.append(load_sample())  # the workers wait (they sleep): others' work
        for round_ in range(settings.repeats):
            shift = round_ % max(1, len(alive))  # nobody always goes first
            for result in [*alive[shift:], *alive[:shift]]:
                label = f"{result.combo.label} window {round_ + 1}/{settings.repeats}"
                if not session.window(result, label):
                    alive.remove(result)
            busy.append(load_sample())
            speeds = {r.combo.label: _speeds(r, settings.steps) for r in alive}
            # from the fourth window on (two from each of a CPU combination's processes):
            # a few windows of a busy machine can mislead
            early = max(EARLIEST_STOP, settings.repeats // 2) <= round_ + 1 < settings.repeats
            losers = clear_losers(speeds) if early else []
            for result in [r for r in alive if r.combo.label in losers]:
                result.stopped_early = True
                alive.remove(result)
                session.done += settings.repeats - round_ - 1  # the windows it skips
        leaders = sorted(
            alive, key=lambda r: spread(_speeds(r, settings.steps)).median, reverse=True
        )[:2]
        if settings.retime and len(leaders) == 2:
            first, second = (_speeds(r, settings.steps) for r in leaders)
            if compare(first, second).tie:
                session.total += EXTRA_WINDOWS * 2
                for extra in range(EXTRA_WINDOWS):
                    for result in leaders:
                        session.window(result, f"{result.combo.label} extra window {extra + 1}")
        session.say("stopping the workers")
        session.finish(pending)
    except BaseException:
        session.kill()
        raise
    session.done = session.total
    session.say("done")
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
        remarks=session.remarks,
    )
