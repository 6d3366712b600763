"""Training you can watch (``--strategy cpu``): FLOPs and MFU, peak memory, the profiler
trace, MLflow, and the guard that drops threads when other work takes the cores."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from paratrain.cli.main import main
from paratrain.launching import threads
from paratrain.models import DigitsCNN
from paratrain.utils.flops import peak_of, table_peak, training_flops

HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_peak_table_holds_dense_figures_most_specific_name_first() -> None:
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12  # not 1,979 (2:4 sparse)
    assert table_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert table_peak("NVIDIA L40S", "bf16") == 362e12  # not L4's
    assert table_peak("NVIDIA L4", "32") == 30.3e12
    assert table_peak("NVIDIA A100-SXM4-80GB", "32") == 19.5e12
    assert table_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert table_peak("NVIDIA A10G", "bf16") is None  # not in the table: measured
    assert table_peak("Some Future GPU", "bf16") is None
    cpu = peak_of(torch.device("cpu"), "32")
    assert cpu.source == "matmul probe" and cpu.flops_per_second > 0


def test_flops_are_counted_on_a_copy_leaving_model_and_generators_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 3), nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    rng = torch.get_rng_state()
    # forward 2*4*8*3, and as much for the weight's gradient (the input needs none)
    assert training_flops(model, nn.CrossEntropyLoss(), x, y) == 2 * 2 * 4 * 8 * 3
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_contention_guard_says_so_once_and_keeps_the_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    delays = iter([0.0, 0.0, 5.0])  # quiet, then waiting for cores most of the time
    monkeypatch.setattr(threads, "run_delay_seconds", lambda: next(delays))
    torch.set_num_threads(2)
    guard = threads.ContentionGuard(2, interval=0.0)
    assert guard.check() is None and torch.get_num_threads() == 2
    note = guard.check()
    assert note is not None and "keeps its 2 intra-op threads" in note
    assert torch.get_num_threads() == 2 and guard.check() is None  # the same sums, said once
    assert threads.ContentionGuard(1).check() is None  # one thread: nothing to say


@pytest.mark.slow
def test_metrics_trace_tensorboard_and_mlflow_of_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, store = tmp_path / "run", tmp_path / "mlruns"
    argv = ["train", "--strategy", "cpu", "--max-steps", "3", "--no-progress", "--tensorboard"]
    argv += ["--profile", "2", "--out", str(out)]
    if HAS_MLFLOW:
        argv += ["--mlflow", str(store)]
    assert main(argv) == 0, capsys.readouterr().err
    (train,) = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert "mfu" not in (out / "metrics.jsonl").read_text()  # that file stays reproducible
    x = torch.zeros(32, 1, 8, 8)
    per_sample = training_flops(DigitsCNN(), nn.CrossEntropyLoss(), x, torch.zeros(32).long())
    assert per_sample is not None and train["flops_per_sample"] == per_sample / 32
    assert train["samples_per_second"] > 0 and 0 < train["mfu"] < 1
    assert train["mfu_peak"]["source"] == "matmul probe"  # the CPU: measured, said so
    # the threads it trained with: those recorded, whatever the load did mid-run (threads.py)
    chosen = json.loads((out / "config.json").read_text())["runtime"]["threads"]["threads"]
    assert train["peak_memory_bytes"]["cpu"] > 0 and train["threads"] == chosen
    # the profiler trace (Chrome trace format: TensorBoard and Perfetto open it)
    (trace,) = (out / "profile").glob("rank0.*.pt.trace.json")
    names = {event["name"] for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert "throughput/mfu" in events.Tags()["scalars"]
    if not HAS_MLFLOW:
        pytest.skip("mlflow is not installed (pip install 'paratrain[mlflow]'): not checked")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("paratrain").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["config.recipe"] == "digits"
    assert run.data.params["runtime.threads.threads"] == str(chosen)
    assert set(run.data.metrics) >= {"train_loss", "eval_loss", "samples_per_second", "mfu"}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"model.safetensors", "config.json"}


def test_mlflow_missing_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow fails
    assert main(["train", "--mlflow", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'paratrain[mlflow]'" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
