"""`paratrain bench` without running workers: combinations, recommendation, reports, chart.

The end-to-end runs (real worker processes, ddp over gloo, out-of-memory) are in
test_bench_cli.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from paratrain.cli.main import main
from paratrain.strategies import registry
from paratrain.strategies.base import Strategy
from paratrain.tools.bench.chart import write_chart
from paratrain.tools.bench.combos import (
    Combo,
    default_precisions,
    enumerate_combos,
    not_by_default,
    parse_batch_sizes,
    parse_precision_list,
    parse_strategy_list,
)
from paratrain.tools.bench.crossover import crossover_size, measure_crossover
from paratrain.tools.bench.placement import measure_placement
from paratrain.tools.bench.recommend import Candidate, recommend
from paratrain.tools.bench.report import BENCH_JSON, check_out, report_dict, write_json
from paratrain.tools.bench.results import BenchReport, BenchSettings, RunResult
from paratrain.tools.bench.task import TaskSource
from paratrain.tools.bench.worker import collect
from paratrain.utils.errors import UserError

no_gpu = pytest.mark.skipif(
    torch.cuda.is_available() or torch.backends.mps.is_available(),
    reason="checks what a machine without a GPU reports",
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- combinations ------------------------------------------------------------------------------
@no_gpu
def test_combos_run_what_the_machine_supports_and_say_why_not_the_rest() -> None:
    combos = enumerate_combos(["cpu", "ddp", "dp", "dp-balanced", "cuda"], ["32"], [1, 8], "2")
    by = {(c.strategy, c.batch_size): c for c in combos}
    assert by["cpu", 1].skip_reason is None and by["cpu", 8].skip_reason is None
    assert by["cpu", 8].device_names == ("cpu",)  # a one-device strategy ignores --devices 2
    assert by["ddp", 8].skip_reason is None and by["ddp", 8].processes == 2
    assert "smaller than the 2 devices" in str(by["ddp", 1].skip_reason)
    # dp and cuda cannot run at all here: one row each, with the reason
    assert "CUDA" in str(by["dp", 1].skip_reason) and ("dp", 8) not in by
    assert "CUDA" in str(by["cuda", 1].skip_reason)
    # --devices 2 means two CUDA GPUs to the balanced DataParallel: skipped, with its message
    assert "CUDA" in str(by["dp-balanced", 1].skip_reason)
    balanced = enumerate_combos(["dp-balanced"], ["32"], [8], "cpu,cpu")[0]
    assert balanced.skip_reason is None and balanced.device_names == ("cpu", "cpu")


@no_gpu
def test_default_combos_are_every_available_strategy_at_native_precisions() -> None:
    combos = enumerate_combos(None, None, [32], None)
    runnable = {(c.strategy, c.precision) for c in combos if c.skip_reason is None}
    skipped = {c.strategy for c in combos if c.skip_reason is not None}
    precisions = default_precisions("cpu")
    assert precisions[0] == "32"
    layouts = ("cpu", "ddp")
    assert runnable == {(s, p) for s in layouts for p in precisions}
    assert {"cuda", "dp", "mps", "dp-balanced", "fsdp", "pipeline"} <= skipped
    fsdp = next(c for c in combos if c.strategy == "fsdp")
    assert "cannot be faster than ddp" in str(fsdp.skip_reason)
    named = enumerate_combos(["fsdp", "pipeline"], ["32"], [32], None)  # measured when named
    assert all(c.skip_reason is None for c in named)
    balanced = next(c for c in combos if c.strategy == "dp-balanced")
    assert "test layout" in str(balanced.skip_reason)
    ddp = next(c for c in combos if c.strategy == "ddp")
    assert ddp.devices == "cpu,cpu" and ddp.processes == 2


def test_four_devices_add_the_two_dimensional_layouts_of_fsdp_and_pipeline() -> None:
    """--devices cpu,cpu,cpu,cpu: fsdp brings hsdp 2x2 (--replicate 2) and fsdp x tp 2x2
    (--tp 2), pipeline brings pipeline 2x2 (--replicate 2), measured when named and left out
    of the default set on CPU processes as fsdp and pipeline are; a layout that refuses the
    model (--tp for a model other than the GPT) is skipped with its reason; 3 devices and
    ddp make none."""
    from paratrain.models import GPT
    from paratrain.tools.bench.combos import refuse_models
    from paratrain.tools.bench.pool import run_spec

    four = "cpu,cpu,cpu,cpu"
    named = enumerate_combos(["ddp", "fsdp", "pipeline"], ["32"], [8], four)
    assert [c.label for c in named] == [
        "ddpx4 32 b8", "fsdpx4 32 b8", "hsdp 2x2 32 b8", "fsdp x tp 2x2 32 b8",
        "pipelinex4 32 b8", "pipeline 2x2 32 b8",
    ]  # fmt: skip
    assert all(c.skip_reason is None and c.processes == 4 for c in named)
    shapes = {c.label.split(" 32")[0]: (c.replicate, c.tp) for c in named}
    assert shapes["hsdp 2x2"] == (2, 1) and shapes["fsdp x tp 2x2"] == (1, 2)
    assert shapes["pipeline 2x2"] == (2, 1) and shapes["fsdpx4"] == (1, 1)
    settings = BenchSettings(TaskSource(recipe="digits"))
    specs = {c.label: run_spec(settings, c) for c in named}
    assert (specs["hsdp 2x2 32 b8"].replicate, specs["fsdp x tp 2x2 32 b8"].tp) == (2, 2)
    default = {c.label: c.skip_reason for c in enumerate_combos(None, ["32"], [8], four)}
    # left out of the default set: CPU processes on a machine with a GPU for that reason
    gpu = torch.cuda.is_available()
    left_out = "a CPU layout on a machine with a GPU" if gpu else "cannot be faster than ddp"
    assert left_out in str(default["hsdp 2x2"])
    assert left_out in str(default["fsdp x tp 2x2"])
    assert (left_out if gpu else "the bubble") in str(default["pipeline 2x2"])
    three = enumerate_combos(["fsdp", "pipeline"], ["32"], [8], "cpu,cpu,cpu")
    assert [(c.replicate, c.tp) for c in three] == [(1, 1), (1, 1)]
    digits = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4, 10))
    refused = {c.label: c.skip_reason for c in refuse_models(named, digits)}
    assert "--tp has a plan for paratrain's built-in GPT" in str(refused["fsdp x tp 2x2 32 b8"])
    assert refused["hsdp 2x2 32 b8"] is None and refused["ddpx4 32 b8"] is None
    gpt = {c.label: c.skip_reason for c in refuse_models(named, GPT(width=32, depth=2))}
    assert gpt["fsdp x tp 2x2 32 b8"] is None and gpt["pipeline 2x2 32 b8"] is None
    assert "needs at least 4 layers" in str(gpt["pipelinex4 32 b8"])  # 2 blocks, 4 stages


CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize("strategy", ["dp", "dp-balanced", "ddp"])
def test_with_one_gpu_the_layouts_for_several_are_left_to_strategies(strategy: str) -> None:
    # What enumerate_combos gets on a machine with one GPU (--devices defaults to "1")...
    reason = not_by_default(strategy, [GPU0], 1, cuda_devices=1)
    assert reason is not None and "one" in reason and "--strategies" in reason
    assert "cuda:0,cuda:0" in reason  # how to measure the code path on that GPU anyway
    # ...and with two: measured by default.
    processes = 2 if strategy == "ddp" else 1
    assert not_by_default(strategy, [GPU0, GPU1], processes, cuda_devices=2) is None


def test_what_the_default_set_measures_by_machine() -> None:
    assert not_by_default("cuda", [GPU0], 1, cuda_devices=1) is None
    assert not_by_default("cuda", [GPU0], 1, cuda_devices=2) is None
    assert not_by_default("cpu", [CPU], 1, cuda_devices=0) is None
    assert not_by_default("ddp", [CPU, CPU], 2, cuda_devices=0) is None
    assert not_by_default("fsdp", [GPU0, GPU1], 2, cuda_devices=2) is None  # memory on GPUs
    assert "saves memory" in str(not_by_default("pipeline", [CPU, CPU], 2, cuda_devices=0))
    # CPU layouts on a machine with a GPU (one or more), or with MPS
    for gpus in (1, 2):
        assert "a CPU layout" in str(not_by_default("ddp", [CPU, CPU], 2, cuda_devices=gpus))
        assert "a CPU layout" in str(not_by_default("cpu", [CPU], 1, cuda_devices=gpus))
    assert "a CPU layout" in str(not_by_default("cpu", [CPU], 1, cuda_devices=0, mps=True))
    # one process repeating a device, wherever
    repeated = "one process repeating a device"
    assert repeated in str(not_by_default("dp-balanced", [CPU, CPU], 1, cuda_devices=0))
    assert repeated in str(not_by_default("dp", [GPU1, GPU1], 1, cuda_devices=2))


class _MetaStrategy(Strategy):
    """A strategy registered only for this test: its device has no autocast."""

    name = "test-meta"
    description = "test only"

    @classmethod
    def resolve_devices(cls, spec: str | None) -> list[torch.device]:
        return [torch.device("meta")]

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model


def test_a_newly_registered_strategy_is_benched_and_its_precisions_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(registry._REGISTRY, _MetaStrategy.name, _MetaStrategy)
    combos = enumerate_combos(["test-meta"], ["32", "bf16"], [4], None)
    assert [c.precision for c in combos] == ["32", "bf16"]
    assert combos[0].skip_reason is None
    assert "autocast is not available on meta" in str(combos[1].skip_reason)


def test_lists_are_parsed_and_bad_entries_named() -> None:
    assert parse_strategy_list("cpu, ddp,cpu") == ["cpu", "ddp"]
    assert parse_precision_list("fp32,bf16-mixed,16") == ["32", "bf16", "fp16"]
    assert parse_batch_sizes("8,16,8") == [8, 16]
    assert parse_strategy_list(None) is None
    with pytest.raises(UserError, match="valid strategies"):
        parse_strategy_list("cpu,warp")
    with pytest.raises(UserError, match="at least 1"):
        parse_batch_sizes("8,0")
    with pytest.raises(UserError, match="not a number"):
        parse_batch_sizes("8,x")
    with pytest.raises(UserError, match="valid precisions"):
        parse_precision_list("int8")


# -- the recommendation ------------------------------------------------------------------------
def test_recommendation_picks_the_fastest_with_its_margin() -> None:
    rec = recommend(
        [
            Candidate("cpu 32", "ok", [100, 102, 101]),
            Candidate("ddp 32", "ok", [150, 149, 151]),
            Candidate("cpu bf16", "ok", [120, 121, 119]),
        ]
    )
    assert rec.winner == "ddp 32" and rec.runner_up == "cpu bf16"
    assert not rec.tie
    assert rec.margin == pytest.approx(150 / 120 - 1)
    assert "25.0% faster than cpu bf16" in rec.message


def test_overlapping_ranges_are_a_tie() -> None:
    rec = recommend([Candidate("a", "ok", [100, 110, 90]), Candidate("b", "ok", [105, 95, 100])])
    assert rec.tie and rec.winner in ("a", "b") and "tie" in rec.message


def test_faster_in_too_few_of_the_shared_rounds_is_a_tie() -> None:
    # 14% apart, but b was the faster one in two of the five rounds both were timed in
    a, b = [111, 140, 125, 98, 130], [90, 110, 108, 120, 135]
    rec = recommend([Candidate("a", "ok", a), Candidate("b", "ok", b)])
    assert rec.winner == "a" and rec.tie
    assert "medians 13.6% apart, but faster in only 3 of 5 rounds" in rec.message


def test_faster_in_every_round_wins_though_the_machine_drifted() -> None:
    # The whole machine slowed down as the bench went on: each range covers the other's
    # median, yet round by round (seconds apart) a was always about 10% faster.
    a = [1100, 1045, 990, 935, 880]
    b = [1000, 950, 900, 850, 800]
    rec = recommend([Candidate("a", "ok", a), Candidate("b", "ok", b)])
    assert rec.winner == "a" and not rec.tie and "10.0% faster than b" in rec.message


def test_one_outlier_window_does_not_make_a_tie() -> None:
    # The winner's range is wide only because of one fast window; the gap is real.
    fast = [73_000, 82_000, 70_000, 82_000, 54_000, 111_000]
    slow = [31_000, 23_000, 33_500, 37_000, 40_000, 35_500]
    rec = recommend([Candidate("a", "ok", fast), Candidate("b", "ok", slow)])
    assert rec.winner == "a" and not rec.tie


def test_out_of_memory_and_skipped_are_excluded_however_fast() -> None:
    rec = recommend(
        [
            Candidate("big batch", "oom", [10_000]),
            Candidate("dp", "skipped"),
            Candidate("cpu", "ok", [50, 51]),
            Candidate("ddp", "error"),
        ]
    )
    assert rec.winner == "cpu" and rec.runner_up is None and rec.margin is None
    assert rec.excluded == {"big batch": "oom", "dp": "skipped", "ddp": "error"}
    assert "the only layout that fits in memory (big batch: out of memory)" in rec.message


def test_nothing_to_recommend_when_all_are_skipped() -> None:
    rec = recommend([Candidate("dp", "skipped"), Candidate("cuda", "skipped")])
    assert rec.winner is None and "nothing to recommend" in rec.message
    assert recommend([]).winner is None


# -- merging the processes' records ------------------------------------------------------------
def _record(tmp: Path, rank: int, **fields: object) -> None:
    memory = {"host": {"rank": rank, "peak_rss_bytes": 1000 + rank}, "devices": []}
    (tmp / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "memory": memory, **fields}))


def test_a_group_is_as_slow_as_its_slowest_process(tmp_path: Path) -> None:
    _record(tmp_path, 0, status="ok", seconds=[1.0, 3.0], gathered_bytes_per_step=None)
    _record(tmp_path, 1, status="ok", seconds=[2.0, 1.5])
    merged = collect(tmp_path, 2)
    assert merged["status"] == "ok" and merged["seconds"] == [2.0, 3.0]
    assert [h["peak_rss_bytes"] for h in merged["memory"]["host"]] == [1000, 1001]


def test_out_of_memory_on_one_rank_explains_the_others_error(tmp_path: Path) -> None:
    _record(tmp_path, 0, status="error", reason="RuntimeError: Connection closed by peer")
    _record(tmp_path, 1, status="oom", reason="OutOfMemoryError: CUDA out of memory")
    merged = collect(tmp_path, 2)
    assert merged["status"] == "oom" and "out of memory" in merged["reason"]


def test_a_failed_group_is_named_by_its_first_line_and_kept_whole(tmp_path: Path) -> None:
    """A failed group's message names the rank first; its stack follows (where the last
    line, ``File "<string>", line 1 in <module>``, says nothing)."""
    from paratrain.tools.bench.worker import LAUNCH_RECORD, _one_line
    from paratrain.utils.errors import LaunchError

    stuck = LaunchError(
        "rank 1 (pid 4242) made no progress for 612s (--hang-timeout / "
        "PARATRAIN_HANG_TIMEOUT); every process was stopped. Its Python stack:\n"
        'Thread 0x1 (most recent call first):\n  File "<string>", line 1 in <module>'
    )
    assert _one_line(stuck) == (
        "LaunchError: rank 1 (pid 4242) made no progress for 612s (--hang-timeout / "
        "PARATRAIN_HANG_TIMEOUT); every process was stopped. Its Python stack:"
    )
    assert _one_line(RuntimeError("while training:\nRuntimeError: closed")) == (
        "RuntimeError: RuntimeError: closed"
    )
    record = {"status": "error", "reason": _one_line(stuck), "traceback": str(stuck)}
    (tmp_path / LAUNCH_RECORD).write_text(json.dumps(record))
    merged = collect(tmp_path, 2)
    assert merged["reason"].startswith("LaunchError: rank 1 (pid 4242) made no progress")
    assert merged["traceback"].endswith("line 1 in <module>")


def test_a_missing_rank_is_an_error(tmp_path: Path) -> None:
    _record(tmp_path, 0, status="ok", seconds=[1.0])
    merged = collect(tmp_path, 2)
    assert merged["status"] == "error" and "1 of 2" in merged["reason"]


# -- outputs -------------------------------------------------------------------------------------
def _report() -> BenchReport:
    settings = BenchSettings(TaskSource(recipe="digits"), steps=10)
    spec = {"steps": 10}
    fast = RunResult(Combo("ddp", "32", 32, "2", ("cpu", "cpu"), 2), "ok", spec=spec)
    fast.seconds, fast.retimed_seconds = [0.10, 0.11], [0.12]
    fast.memory = {
        "devices": [],
        "host": [{"rank": 0, "peak_rss_bytes": 3 << 28}, {"rank": 1, "peak_rss_bytes": 3 << 28}],
    }
    slow = RunResult(Combo("cpu", "32", 32, None, ("cpu",)), "ok", spec=spec)
    slow.seconds = [0.3, 0.31]
    slow.memory = {"devices": [], "host": [{"rank": 0, "peak_rss_bytes": 300 << 20}]}
    oom = RunResult(Combo("cpu", "32", 4096, None, ("cpu",)), "oom", "MemoryError", spec=spec)
    skipped = RunResult(Combo("dp", "-", 32, "2"), "skipped", "this machine has no CUDA GPU")
    results = [fast, slow, oom, skipped]
    rec = recommend([r.candidate() for r in results])
    return BenchReport(settings, results, rec, "t0", "t1", 1.0, 1437)


def test_bench_json_holds_results_hardware_versions_and_every_configuration(
    tmp_path: Path,
) -> None:
    data = json.loads(write_json(_report(), tmp_path).read_text())
    for key in ("machine", "versions", "settings", "results", "recommendation", "started_at"):
        assert key in data
    assert data["machine"]["cpu_cores"] >= 1 and data["versions"]["torch"] == torch.__version__
    first = data["results"][0]
    assert first["label"] == "ddpx2 32 b32" and first["status"] == "ok"
    assert first["samples_per_second"]["repeats"] == pytest.approx(
        [3200.0, 2909.09, 2666.67], rel=1e-4
    )
    assert isinstance(first["samples_per_second"]["median"], float)
    assert first["combination"]["device_names"] == ["cpu", "cpu"]
    assert first["config"] == {"steps": 10}
    assert data["results"][2]["status"] == "oom" and data["results"][2]["reason"] == "MemoryError"
    assert data["results"][3]["samples_per_second"] is None
    assert data["recommendation"]["winner"] == "ddpx2 32 b32"
    assert data["recommendation"]["excluded"] == {"cpu 32 b4096": "oom", "dp": "skipped"}
    assert report_dict(_report())["task"] == {"name": "digits", "train_samples": 1437}


def test_out_refuses_to_replace_a_bench_json(tmp_path: Path) -> None:
    (tmp_path / BENCH_JSON).write_text("{}")
    with pytest.raises(UserError, match="--overwrite"):
        check_out(tmp_path, overwrite=False)
    assert check_out(tmp_path, overwrite=True) == tmp_path
    assert (tmp_path / BENCH_JSON).read_text() == "{}"  # replaced only once results exist
    with pytest.raises(UserError, match="is a file"):
        check_out(tmp_path / BENCH_JSON, overwrite=True)


@pytest.mark.slow
def test_chart_is_a_png(tmp_path: Path) -> None:
    assert write_chart(_report(), tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_SIGNATURE


def test_without_matplotlib_no_chart_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    assert not write_chart(_report(), tmp_path / "bench.png")
    assert not (tmp_path / "bench.png").exists()


# -- micro-benchmarks ------------------------------------------------------------------------------
@no_gpu
@pytest.mark.parametrize("which", ["placement", "crossover"])
def test_micro_benchmarks_say_there_is_no_gpu_and_exit_0(
    which: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", which]) == 0
    assert "no GPU (CUDA or MPS)" in capsys.readouterr().out


def test_micro_benchmarks_refuse_the_cpu_as_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "crossover", "--devices", "cpu"]) == 2
    assert "choose a GPU" in capsys.readouterr().err


def test_crossover_is_where_the_gpu_starts_winning_for_good() -> None:
    sizes = [64, 128, 256, 512]
    assert crossover_size(sizes, [1, 2, 4, 8], [3, 3, 3, 3]) == 256
    assert crossover_size(sizes, [1, 2, 4, 8], [0.5, 3, 3, 3]) == 256  # an early fluke
    assert crossover_size(sizes, [1, 2, 4, 8], [2, 3, 5, 9]) is None
    assert crossover_size(sizes, [1, 2, 4, 8], [2, 1, 5, 9]) is None  # loses again


def test_micro_benchmark_measurements_have_their_rows() -> None:
    # The functions take any device; on the CPU this checks their shape, not their speed.
    rows = measure_placement(torch.device("cpu"), size=32, repeats=2)
    assert [r.seconds is None for r in rows] == [False, False, False, False, True]
    assert rows[0].bytes_moved == 32 * 32 * 4 and rows[0].gb_per_second is not None
    cross = measure_crossover(torch.device("cpu"), [8, 16], repeats=2)
    assert [r.size for r in cross] == [8, 16] and cross[1].cpu.count == 2


@pytest.mark.cuda
def test_micro_benchmarks_run_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "placement", "--size", "2048", "--repeats", "3", "--json"]) == 0
    placement = json.loads(capsys.readouterr().out)
    pinned = next(r for r in placement["rows"] if r["name"].startswith("copy pinned"))
    assert pinned["gb_per_second"] > 0
    assert main(["bench", "crossover", "--sizes", "64,2048", "--repeats", "2", "--json"]) == 0
    crossover = json.loads(capsys.readouterr().out)
    assert [r["size"] for r in crossover["rows"]] == [64, 2048]


@pytest.mark.slow
def test_predicted_peaks_stand_next_to_the_measured_ones() -> None:
    """--strategy cpu and ddp on cpu,cpu: paratrain plan's peak per device (fake tensors)."""
    from rich.console import Console

    from paratrain.cli.commands.bench import predict_memory
    from paratrain.cli.commands.plan import recipe_builder
    from paratrain.tools.bench.report import build_table
    from paratrain.tools.plan import plan_memory, trace_step

    report = _report()
    predict_memory(report)
    ddp, cpu, oom, skipped = report.results
    assert ddp.predicted_peak_bytes is not None and len(ddp.predicted_peak_bytes) == 2
    assert cpu.predicted_peak_bytes is not None and len(cpu.predicted_peak_bytes) == 1
    assert oom.predicted_peak_bytes is not None and skipped.predicted_peak_bytes is None
    build, _ = recipe_builder("digits")
    plan = plan_memory(lambda b: trace_step(build, b), "digits", 32, "32", 2, "cpu", 1 << 40, "-")
    assert cpu.predicted_peak_bytes == [plan.layouts[0].peak]  # the plan's own figure
    assert oom.predicted_peak_bytes[0] > 10 * cpu.predicted_peak_bytes[0]  # batch 4096
    console = Console(width=200, record=True)
    console.print(build_table(report))
    assert "predicted" in console.export_text()
    assert report_dict(report)["results"][1]["predicted_peak_bytes"] == cpu.predicted_peak_bytes


def test_activation_checkpointing_adds_a_combination_where_the_strategy_allows_it() -> None:
    from paratrain.tools.bench.combos import with_activation_checkpointing
    from paratrain.tools.bench.pool import run_spec

    combos = enumerate_combos(["cpu", "dp-balanced"], ["32"], [8], "cpu,cpu")
    doubled = with_activation_checkpointing(combos)
    assert [c.label for c in doubled] == ["cpu 32 b8", "cpu 32 b8 ac", "dp-balancedx2 32 b8"]
    settings = BenchSettings(TaskSource(recipe="digits"), activation_checkpointing=True)
    assert run_spec(settings, doubled[1]).activation_checkpointing
    assert not run_spec(settings, doubled[0]).activation_checkpointing


def test_threads_are_a_dimension_on_cpu_layouts_at_equal_total_threads() -> None:
    """``--devices cpu,cpu`` layouts on 2 cores: paratrain's count (cores / processes) for
    each, one thread as well for one process; ``--threads`` lists the counts instead."""
    from paratrain.tools.bench.combos import parse_thread_counts, with_thread_counts
    from paratrain.tools.bench.pool import run_spec

    def chosen(processes: int) -> int:
        return max(1, 2 // processes)

    combos = enumerate_combos(["cpu", "ddp"], ["32"], [8], "cpu,cpu")
    default = with_thread_counts(combos, None, chosen)
    assert [c.label for c in default] == ["cpu 32 b8", "cpu 32 b8 t1", "ddpx2 32 b8"]
    settings = BenchSettings(TaskSource(recipe="digits"))
    spec_of = {c.label: run_spec(settings, c) for c in default}
    assert spec_of["cpu 32 b8 t1"].threads == 1
    # the unlabelled ones get the count paratrain chooses here (as train would)
    from paratrain.launching.threads import choose_for

    assert spec_of["cpu 32 b8"].threads == choose_for(1).threads
    assert spec_of["ddpx2 32 b8"].threads == choose_for(2).threads

    asked = with_thread_counts(combos, parse_thread_counts("2,1,2"), chosen)
    assert [c.label for c in asked] == [
        "cpu 32 b8 t2", "cpu 32 b8 t1", "ddpx2 32 b8 t2", "ddpx2 32 b8 t1"
    ]  # fmt: skip
    assert with_thread_counts(combos, None, lambda _: 1) == combos  # one core: nothing to add
    assert parse_thread_counts(None) is None
