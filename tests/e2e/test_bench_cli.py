"""`paratrain bench` end to end: real worker processes, ddp over gloo, out-of-memory, scripts.

Kept small (few steps, one precision): each combination still starts its own processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.cli.main import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

HUNGRY_SCRIPT = '''
import torch
from torch import nn


class Hungry(nn.Module):
    """Fine for small batches; from 16 samples on, asks for 4 PiB (no machine has it)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        if x.shape[0] >= 16:
            torch.empty(2**50, device=x.device)
        return self.linear(x)


def sample_batch(n):
    return torch.randn(n, 4), torch.randint(0, 3, (n,))


def factory():
    return Hungry(), nn.CrossEntropyLoss(), sample_batch
'''


def hungry_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HUNGRY_SCRIPT in ``tmp_path``, with one thread count (no t1 combinations: test_bench)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = tmp_path / "hungry.py"
    script.write_text(HUNGRY_SCRIPT)
    return script


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["bench", "--no-progress", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_cpu_and_ddp_are_measured_in_fresh_processes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    out = tmp_path / "bench"
    argv = ["--strategies", "cpu,ddp", "--devices", "cpu,cpu", "--precisions", "32"]
    argv += ["--steps", "3", "--warmup", "1", "--repeats", "2", "--out", str(out)]
    code, stdout, _ = bench(capsys, *argv, "--threads", "1")
    assert code == 0, stdout
    data = json.loads((out / "bench.json").read_text())
    results = {r["label"]: r for r in data["results"]}
    assert set(results) == {"cpu 32 b32 t1", "ddpx2 32 b32 t1"}
    cpu, ddp = results["cpu 32 b32 t1"], results["ddpx2 32 b32 t1"]
    assert cpu["status"] == ddp["status"] == "ok"
    for result in (cpu, ddp):  # as asked, in every process
        assert result["config"]["threads"] == 1
        assert result["runtime"]["threads"]["threads"] == 1
    # the wait policy `paratrain train` would have: the command's own in one process
    # (OpenMP's default, spinning, on a quiet machine), sleeping in launched ranks
    assert cpu["runtime"]["threads"]["wait_policy"] == "default"
    assert ddp["runtime"]["threads"]["wait_policy"] == "PASSIVE"
    assert ddp["runtime"]["world_size"] == 2 and ddp["runtime"]["strategy"] == "ddp"
    assert [h["rank"] for h in ddp["memory"]["host"]] == [0, 1]  # every process's peak RSS
    assert all(h["peak_rss_bytes"] > 0 for h in ddp["memory"]["host"])
    assert cpu["gathered_bytes_per_step"] is None
    # paratrain plan's prediction per device stands next to the measured peak
    assert len(cpu["predicted_peak_bytes"]) == 1 and len(ddp["predicted_peak_bytes"]) == 2
    assert "predicted" in stdout
    # two worker processes each on the CPU, for all of their windows: the rounds take turns
    # between them (interleaved with the other combination's); two more windows each only
    # where the two combinations were within noise of each other
    for result in (cpu, ddp):
        windows = len(result["timed_window_seconds"]["first"])
        assert windows in (2, 4) and result["timed_window_seconds"]["retimed"] == []
        assert result["samples_per_second"]["count"] == windows and len(result["runs"]) == 2
        assert [run["windows"] for run in result["runs"]] == [windows // 2, windows // 2]
        assert result["config"]["steps"] == 3 and result["config"]["warmup"] == 1
    assert data["settings"]["instances"] is None  # the default: two on the CPU
    assert data["recommendation"]["winner"] in results
    assert data["settings"]["strategies"] == ["cpu", "ddp"]
    assert (out / "bench.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "recommendation:" in stdout and "ddpx2 32 b32 t1" in stdout

    before = (out / "bench.json").read_bytes()
    code, _, err = bench(capsys, *argv, "--threads", "1")
    assert code == 2 and "--overwrite" in err
    assert (out / "bench.json").read_bytes() == before


@pytest.mark.slow
def test_four_devices_measure_the_two_dimensional_layouts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--strategies fsdp,pipeline on cpu,cpu,cpu,cpu (digits): hsdp 2x2 and pipeline 2x2 run
    in 4 real processes next to fsdp and pipeline over 4, with the plan's prediction per
    process; fsdp x tp 2x2 is skipped, saying why (digits' model is not the GPT)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "bench"
    argv = ["--recipe", "digits", "--strategies", "fsdp,pipeline", "--precisions", "32"]
    argv += ["--devices", "cpu,cpu,cpu,cpu", "--batch-sizes", "16", "--steps", "2"]
    argv += ["--warmup", "1", "--repeats", "1", "--instances", "1", "--no-plot"]
    code, stdout, _ = bench(capsys, *argv, "--out", str(out))
    assert code == 0, stdout
    results = {r["label"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    assert list(results) == [
        "fsdpx4 32 b16", "hsdp 2x2 32 b16", "fsdp x tp 2x2 32 b16", "pipelinex4 32 b16",
        "pipeline 2x2 32 b16",
    ]  # fmt: skip
    tp = results.pop("fsdp x tp 2x2 32 b16")
    assert tp["status"] == "skipped" and "--tp has a plan for paratrain's built-in GPT" in str(
        tp["reason"]
    )
    for label, result in results.items():
        assert result["status"] == "ok", (label, result["reason"])
        assert result["runtime"]["world_size"] == 4 and len(result["predicted_peak_bytes"]) == 4
    assert results["hsdp 2x2 32 b16"]["runtime"]["mesh"] == {"replicate": 2, "shard": 2}
    assert results["pipeline 2x2 32 b16"]["runtime"]["mesh"] == {"replicate": 2, "stage": 2}
    assert "hsdp 2x2 32 b16" in stdout and "--tp has a plan" in stdout


@pytest.mark.slow
def test_out_of_memory_is_a_result_and_the_rest_still_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = hungry_script(tmp_path, monkeypatch)
    out = tmp_path / "bench"
    # --json, and progress as plain lines on stderr (not a terminal here)
    code = main(
        [
            "bench",
            "--json",
            f"--script={script}:factory",
            "--strategies=cpu",
            "--precisions=32",
            "--batch-sizes=4,64",
            "--steps=2",
            "--warmup=0",
            "--repeats=1",
            "--no-plot",
            f"--out={out}",
        ]
    )
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    data = json.loads((out / "bench.json").read_text())
    assert json.loads(stdout) == data
    assert "bench: [0/4] starting cpu 32 b4" in stderr and "bench: [4/4] done" in stderr
    assert "bench: [2/4] cpu 32 b4 window 1/1" in stderr
    assert data["load"]["cores"] >= 1 and len(data["load"]["busy"]) == 3
    status = {r["label"]: (r["status"], r["reason"]) for r in data["results"]}
    assert status["cpu 32 b4"] == ("ok", None)
    assert status["cpu 32 b64"][0] == "oom"
    assert "can't allocate memory" in status["cpu 32 b64"][1]
    assert data["recommendation"]["winner"] == "cpu 32 b4"
    assert data["recommendation"]["excluded"] == {"cpu 32 b64": "oom"}
    assert data["task"]["name"] == "hungry"
    assert not (out / "bench.png").exists()


@pytest.mark.slow
def test_overwrite_replaces_the_earlier_bench_and_its_chart(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = hungry_script(tmp_path, monkeypatch)
    out = tmp_path / "bench"
    out.mkdir()
    (out / "bench.json").write_text('{"earlier": true}\n')
    (out / "bench.png").write_bytes(PNG_SIGNATURE)  # the earlier run's chart
    (out / "notes.txt").write_text("mine\n")
    argv = [f"--script={script}:factory", "--strategies=cpu", "--precisions=32"]
    argv += ["--batch-sizes=4", "--steps=2", "--warmup=0", "--repeats=1", "--instances=1"]
    code, _, err = bench(capsys, *argv, "--no-plot", f"--out={out}")
    assert code == 2 and "--overwrite" in err and (out / "bench.png").exists()
    code, stdout, _ = bench(capsys, *argv, "--no-plot", "--overwrite", f"--out={out}")
    assert code == 0, stdout
    assert "earlier" not in (out / "bench.json").read_text()
    assert not (out / "bench.png").exists()  # no chart this time: none that is not this run's
    assert (out / "notes.txt").read_text() == "mine\n"  # not the bench's: kept


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("missing.py:factory", "no file"),
        ("model.py", "path/to/file.py:factory"),
        ("model.py:nothing", "no function 'nothing'"),
        ("model.py:wrong", "must return (model, loss_fn, sample_batch)"),
        ("model.py:bad_batch", "sample_batch(64) must return (inputs, targets)"),
    ],
)
def test_a_broken_script_is_a_user_error_before_any_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, script: str, message: str
) -> None:
    (tmp_path / "model.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def wrong():\n    return nn.Linear(2, 2)\n"
        "def bad_batch():\n"
        "    return nn.Linear(2, 2), nn.MSELoss(), lambda n: torch.zeros(n, 2)\n"
    )
    target = str(tmp_path / script)
    code, _, err = bench(capsys, "--script", target, "--out", str(tmp_path / "out"))
    assert code == 2 and message in err
    assert not (tmp_path / "out").exists()


def test_bad_options_are_user_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = bench(capsys, "--steps", "0", "--out", str(tmp_path))
    assert code == 2 and "--steps must be at least 1" in err
    code, _, err = bench(capsys, "--instances", "0", "--out", str(tmp_path))
    assert code == 2 and "--instances must be at least 1, got 0" in err
    for bad, message in (("0", "at least 1, got 0"), ("1,x", "'x' is not a number")):
        code, _, err = bench(capsys, "--threads", bad, "--out", str(tmp_path))
        assert code == 2 and "--threads" in err and message in err, err
    code, _, err = bench(capsys, "--batch-sizes", "5000", "--out", str(tmp_path))
    assert code == 2 and "larger than the 1437 training samples" in err
    code, _, err = bench(capsys, "--recipe", "digits", "--script", "x.py:f")
    assert code == 2 and "not allowed with argument" in err
