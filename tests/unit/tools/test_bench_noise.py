"""How sure `paratrain bench` is (no device: synthetic timings and loads): a result within
the noise is never called a winner, and a busy machine is said plainly."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from paratrain.tools.bench.noise import (
    CLEAR_LOSER,
    MachineLoad,
    clear_losers,
    compare,
    relative_spread,
    within_noise,
)
from paratrain.tools.bench.progress import BenchProgress
from paratrain.tools.bench.recommend import Candidate, recommend
from paratrain.tools.bench.stats import spread


def test_a_gap_wider_than_the_noise_is_a_winner() -> None:
    rec = recommend([Candidate("a", "ok", [1000, 1010, 990]), Candidate("b", "ok", [800, 800])])
    assert rec.winner == "a" and not rec.tie and not rec.busy
    assert rec.message.startswith("use a: 1,000 samples/s, 25.0% faster than b")


def test_the_busy_bench_of_the_report_is_no_winner() -> None:
    # Three runs on a busy machine gave cpu 102, 999 and 1,110 samples/s: medians far apart
    # are still noise when the repeats vary that much.
    rec = recommend(
        [Candidate("cpu", "ok", [102, 999, 1110]), Candidate("ddpx2", "ok", [470, 480, 460])]
    )
    assert rec.tie
    assert rec.message.startswith("tie, no winner: cpu (999 samples/s) and ddpx2 (470)")
    assert "faster in only 2 of 3 rounds" in rec.message and "use " not in rec.message


@pytest.mark.parametrize(
    ("a", "b", "noise"),
    [
        ([100, 101, 102], [97.5, 98, 98.5], True),  # 3% apart, tight: below the noise floor
        ([100, 101, 102], [90, 91, 92], False),  # 11% apart, tight: a real difference
        ([100, 130, 115], [95, 100, 99], True),  # ranges overlap
        ([111, 140, 125], [90, 110, 108], True),  # gap smaller than the narrower spread
    ],
)
def test_within_noise(a: list[float], b: list[float], noise: bool) -> None:
    assert within_noise(spread(a), spread(b)) is noise


@pytest.mark.parametrize(
    ("a", "b", "why"),
    [
        # closer than the floor, however consistent
        ([103, 103, 103], [100, 100, 100], "medians 3.0% apart, closer than the 5% floor"),
        # 4 of 5 rounds is enough, 3 of 5 is not; 3 of 3 is needed
        ([120, 120, 120, 120, 90], [100, 100, 100, 100, 100], None),
        ([120, 120, 120, 90, 90], [100, 100, 100, 100, 100], "faster in only 3 of 5 rounds"),
        ([120, 120, 90], [100, 100, 100], "faster in only 2 of 3 rounds"),
        # a clear loser stopped early: only the rounds both were timed in count
        ([120, 121, 119, 122, 90], [100, 101, 99, 100], None),
        # fewer than three shared rounds: the ranges decide
        ([120, 100], [105, 99], "repeats varying by up to 18%"),
        ([120, 121], [100, 101], None),
    ],
)
def test_compare_round_by_round(a: list[float], b: list[float], why: str | None) -> None:
    verdict = compare(a, b)
    assert verdict.tie is (why is not None)
    assert why is None or why in verdict.why


def test_relative_spread() -> None:
    assert relative_spread(spread([90, 100, 110])) == pytest.approx(0.2)
    assert relative_spread(spread([0.0])) == float("inf")


def test_a_busy_machine_is_said_plainly_with_the_advice_to_rerun() -> None:
    busy = MachineLoad(cores=2, busy=(1.0, 2.0, 1.0, 0.0), load_average=(3.2, 4.1))
    assert busy.is_busy and busy.busy_median == 1.0
    assert busy.sentence() == (
        "the machine was busy: other work kept 1.0 of 2 cores busy (load average 3.2, 4.1 "
        "on 2 cores). These figures are not reliable: rerun the bench on a quiet machine"
    )
    quiet = MachineLoad(cores=2, busy=(0.0, 1.0, 0.0), load_average=(0.1, 0.9))
    assert not quiet.is_busy and quiet.sentence().startswith("the machine was quiet")
    gpu = MachineLoad(cores=8, busy=(0.0,), gpu_processes=(4242,))
    assert gpu.is_busy and "other processes on the GPU (4242)" in gpu.sentence()
    assert busy.to_dict()["is_busy"] is True
    rec = recommend([Candidate("a", "ok", [1000, 1001]), Candidate("b", "ok", [500])], True)
    assert rec.busy and "measured on a busy machine: rerun on a quiet one" in rec.message


def test_progress_lines_where_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with BenchProgress(enabled=True) as bar:
        bar.update("cpu 32 b32", 0, 3)
    assert capsys.readouterr().err.startswith("bench: [0/3] cpu 32 b32 (")
    with BenchProgress(enabled=False) as bar:
        bar.update("cpu 32 b32", 0, 3)
    assert capsys.readouterr().err == ""


def test_only_clear_losers_stop_early() -> None:
    leader = [1000.0, 1100.0, 900.0]
    speeds = {
        "leader": leader,
        "close": [850.0, 1200.0],  # overlaps the leader: needs every window
        "far": [100.0, 200.0, 300.0],  # below CLEAR_LOSER of the leader's worst in every one
        "edge": [CLEAR_LOSER * 900.0, 10.0],  # its best equals the bar: kept
        "once": [1.0],  # one window says too little
    }
    assert clear_losers(speeds) == ["far"]
    assert clear_losers({"leader": leader}) == [] and clear_losers({}) == []


class _FakeWorker:
    """A worker that times its windows from a table (samples/s by combination label)."""

    speeds: ClassVar[dict[str, float]] = {}
    calls: ClassVar[list[str]] = []
    #: (label, which of the combination's worker processes) of every window
    turns: ClassVar[list[tuple[str, int]]] = []
    stopped: ClassVar[list[str]] = []

    def __init__(self, spec: Any, processes: int, timeout: float) -> None:
        self.spec, self.seconds = spec, []
        layout = spec.strategy + ("x2" if processes > 1 else "")
        self.label = f"{layout} {spec.precision} b{spec.batch_size}"
        self.instance = sum(1 for label, _ in self.turns if label == f"start {self.label}")
        _FakeWorker.turns.append((f"start {self.label}", self.instance))

    def wait_ready(self) -> bool:
        return True

    def window(self) -> float:
        _FakeWorker.calls.append(self.label)
        _FakeWorker.turns.append((self.label, self.instance))
        self.seconds.append(self.spec.steps * self.spec.batch_size / self.speeds[self.label])
        return self.seconds[-1]

    def ask_stop(self) -> None:
        _FakeWorker.stopped.append(self.label)

    def finish(self) -> dict[str, Any]:
        assert len(self.stopped) == len(self.turns) - len(self.calls)  # all asked first
        run = {"windows": len(self.seconds)}
        return {"status": "ok", "seconds": self.seconds, "memory": {}, "run": run}

    def kill(self) -> None:
        pass


def test_the_bench_interleaves_stops_clear_losers_and_retimes_a_close_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runner's rounds (no processes: a worker that answers from a table)."""
    from paratrain.tools.bench import pool, runner
    from paratrain.tools.bench.task import TaskSource

    _FakeWorker.speeds = {
        "cpu 32 b16": 1000.0,  # the leader
        "cpu 32 b32": 980.0,  # within noise of it: two more windows each
        "ddpx2 32 b16": 100.0,  # a clear loser: stopped after EARLIEST_STOP windows
        "ddpx2 32 b32": 700.0,  # slower, not clearly: every window
    }
    _FakeWorker.calls, _FakeWorker.turns, _FakeWorker.stopped = [], [], []
    monkeypatch.setattr(pool, "WorkerProcess", _FakeWorker)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one count: no t1 combinations (test_bench)
    settings = runner.BenchSettings(
        TaskSource(recipe="digits"), ["cpu", "ddp"], ["32"], [16, 32], "cpu,cpu", steps=4
    )
    seen: list[tuple[str, int, int]] = []
    report = runner.run_bench(settings, lambda what, done, total: seen.append((what, done, total)))
    windows = {r.combo.label: len(r.seconds) for r in report.results}
    assert windows == {"cpu 32 b16": 7, "cpu 32 b32": 7, "ddpx2 32 b16": 4, "ddpx2 32 b32": 5}
    assert [r.combo.label for r in report.results if r.stopped_early] == ["ddpx2 32 b16"]
    # round by round, each round starting one further along
    assert _FakeWorker.calls[:8] == [
        "cpu 32 b16", "cpu 32 b32", "ddpx2 32 b16", "ddpx2 32 b32",
        "cpu 32 b32", "ddpx2 32 b16", "ddpx2 32 b32", "cpu 32 b16",
    ]  # fmt: skip
    assert report.recommendation.tie and report.recommendation.winner == "cpu 32 b16"
    # two worker processes per CPU combination, taking turns window by window
    for label in windows:
        assert [i for what, i in _FakeWorker.turns if what == f"start {label}"] == [0, 1]
        taken = [i for what, i in _FakeWorker.turns if what == label]
        assert taken == [n % 2 for n in range(windows[label])]
        assert len(next(r for r in report.results if r.combo.label == label).runs) == 2
    assert seen[-1] == ("done", seen[-1][2], seen[-1][2])
    assert all(done <= total for _, done, total in seen)


def test_second_workers_only_where_the_host_memory_holds_them() -> None:
    from paratrain.tools.bench.pool import memory_short

    gib = 2**30
    # four workers took 2 GiB: four more need 2 GiB of the 8 left
    assert memory_short(10 * gib, 8 * gib, started=4, more=4) is None
    # four workers took 8 GiB: four more would need 8 of the 2 left
    assert memory_short(10 * gib, 2 * gib, started=4, more=4) == (
        "4 more would need about 8.0 GiB of the 2.0 GiB the host has available"
    )
    assert memory_short(None, 2 * gib, started=4, more=4) is None  # the host does not say


def test_a_host_short_of_memory_gets_one_worker_per_combination(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from paratrain.tools.bench import pool, runner
    from paratrain.tools.bench.report import notes
    from paratrain.tools.bench.task import TaskSource

    _FakeWorker.speeds = {"cpu 32 b16": 1000.0, "cpu 32 b32": 500.0}
    _FakeWorker.calls, _FakeWorker.turns, _FakeWorker.stopped = [], [], []
    monkeypatch.setattr(pool, "WorkerProcess", _FakeWorker)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # the first two workers take 3 GiB each of the 8 GiB available
    available = iter([8 * 2**30, 2 * 2**30])
    monkeypatch.setattr(pool, "available_host_bytes", lambda: next(available))
    settings = runner.BenchSettings(TaskSource(recipe="digits"), ["cpu"], ["32"], [16, 32])
    report = runner.run_bench(settings)
    assert all(len(r.runs) == 1 for r in report.results)
    assert [i for _, i in _FakeWorker.turns] == [0, 0] + [0] * len(_FakeWorker.calls)
    assert report.remarks == [
        "one worker process per combination: 2 more would need about 6.0 GiB of the 2.0 GiB "
        "the host has available"
    ]
    assert notes(report)[0] == report.remarks[0]


def test_a_bench_whose_every_combination_is_skipped_runs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from paratrain.tools.bench import pool, runner
    from paratrain.tools.bench.task import TaskSource

    monkeypatch.setattr(pool, "WorkerProcess", _FakeWorker)
    settings = runner.BenchSettings(
        TaskSource(recipe="digits"), ["dp"], ["32"], [16], "cuda:0,cuda:1"
    )
    report = runner.run_bench(settings)
    assert [r.status for r in report.results] == ["skipped"]
    assert report.recommendation.winner is None
