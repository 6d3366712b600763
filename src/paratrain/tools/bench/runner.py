"""Run every combination in fresh worker processes that stay for all its windows (the
pool, bench/pool.py); the windows are interleaved, combination by combination, round by
round; clear losers stop early, and a close pair gets more windows."""

from __future__ import annotations

import datetime as dt
import os
import time

from paratrain.tools.bench.combos import (
    enumerate_combos,
    refuse_models,
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
from paratrain.tools.bench.pool import ProgressFn, WorkerPool, chosen_threads
from paratrain.tools.bench.recommend import recommend
from paratrain.tools.bench.results import BenchReport, BenchSettings, RunResult
from paratrain.tools.bench.stats import spread, throughputs
from paratrain.tools.bench.task import check_task

__all__ = ["BenchReport", "BenchSettings", "RunResult", "run_bench"]

#: a clear loser is stopped after this many windows at the earliest (and never before half
#: of its windows: its figure stays a median of several, from each of its processes)
EARLIEST_STOP = 4
#: windows added for the two leaders when their first ones are within noise of each other
EXTRA_WINDOWS = 2


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _speeds(result: RunResult, steps: int) -> list[float]:
    return throughputs(result.seconds, steps * result.combo.batch_size)


def run_bench(settings: BenchSettings, progress: ProgressFn | None = None) -> BenchReport:
    """Measure every combination: one worker process each, its windows interleaved with
    the others' round by round; clear losers stop early, and two leaders within noise of
    each other get ``EXTRA_WINDOWS`` more each before recommending."""
    started_at, begin = _now(), time.perf_counter()
    train_samples, batch_sizes, model = check_task(settings.source, settings.batch_sizes)
    combos = enumerate_combos(
        settings.strategies, settings.precisions, batch_sizes, settings.devices
    )
    combos = refuse_models(combos, model)
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
    session = WorkerPool(
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
