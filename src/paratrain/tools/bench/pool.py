"""The worker processes of one bench: started a few at a time (each CPU combination's
second ones only where the host's memory holds them), one window on request, stopped side by
side."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paratrain.launching.threads import choose_for
from paratrain.tools.bench.combos import Combo
from paratrain.tools.bench.noise import cores
from paratrain.tools.bench.process import WorkerProcess
from paratrain.tools.bench.results import BenchSettings, RunResult
from paratrain.tools.bench.worker import RunSpec
from paratrain.utils.peak_memory import available_host_bytes

#: called with (what is running now, how many steps of the bench are done, how many in all)
ProgressFn = Callable[[str, int, int], None]
#: worker processes per CPU combination: a process's luck (where its memory landed, how its
#: threads were placed) moves all of its windows alike, by up to 5-8% on a 2-core machine;
#: two processes, whose rounds alternate, halve what one such draw can do to the figure
CPU_INSTANCES = 2


def chosen_threads(processes: int) -> int:
    """The count paratrain chooses for each of ``processes`` processes, as ``train`` would
    here: the load it follows is the one the bench command saw when it started, before its
    workers loaded the machine."""
    return choose_for(processes).threads


def run_spec(
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
        replicate=combo.replicate,
        tp=combo.tp,
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


class WorkerPool:
    """The worker processes of one bench (each combination's, its windows taking turns among
    them) and the progress count."""

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
                spec = run_spec(self.settings, result.combo, self.chosen)
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
