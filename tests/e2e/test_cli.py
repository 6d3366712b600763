"""`paratrain` commands: outputs, the output contract, user errors and exit codes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.cli import main_in_process, run_paratrain
from safetensors.torch import load_file

from paratrain.cli.main import main
from paratrain.data.cifar import write_fake_cifar_batches

CPU = ("--strategy", "cpu")  # left to auto, a machine with GPUs would train there


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return main_in_process(capsys, *argv)


def train(capsys: pytest.CaptureFixture[str], out: Path, *argv: str) -> tuple[int, str, str]:
    return run(capsys, "train", "--no-progress", "--out", str(out), *argv)


def test_recipes_lists_every_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "recipes")
    assert code == 0
    for name in ("digits (default)", "linear", "cifar10-resnet18"):
        assert name in out


def test_info_json_describes_the_machine(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "info", "--json")
    info = json.loads(out)
    assert code == 0
    assert info["torch"] == torch.__version__
    assert info["cuda_available"] == torch.cuda.is_available()
    assert info["backends"]["gloo"] is True
    assert info["cpu_cores"] >= 1
    assert info["devices"][0]["type"] == "cpu"
    code, out, _ = run(capsys, "info")
    assert "CUDA available" in out and "gloo" in out


def test_help_lists_strategies_from_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in ("auto", "cpu", "cuda", "mps"):
        assert name in out


@pytest.mark.slow
def test_digits_default_run_writes_the_output_contract(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    code, stdout, _ = train(capsys, out, *CPU, "--epochs", "3")
    assert code == 0
    assert "test accuracy" in stdout
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {line["split"] for line in lines} == {"train", "eval"}
    for line in lines:
        assert {"epoch", "step", "split", "loss"} <= set(line)
    evals = [line for line in lines if line["split"] == "eval"]
    assert len(evals) == 3 and all(0.0 <= line["accuracy"] <= 1.0 for line in evals)
    assert evals[-1]["accuracy"] > 0.8
    weights = load_file(str(out / "model.safetensors"))
    assert weights and not any(k.startswith(("module.", "_orig_mod.")) for k in weights)
    config = json.loads((out / "config.json").read_text())
    assert config["status"] == "finished"
    assert config["config"]["recipe"] == "digits"
    assert config["runtime"]["devices"] == ["cpu"]
    assert config["versions"]["torch"] == torch.__version__


@pytest.mark.slow
def test_without_out_a_run_goes_to_runs_recipe_and_time(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`paratrain train` alone (the Quick start) writes runs/digits-<time>: the default
    recipe's name, not "None"."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--strategy", "cpu", "--max-steps", "2", "--no-progress"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("digits-") and (run / "model.safetensors").is_file()
    assert str(Path("runs") / run.name) in capsys.readouterr().out


@pytest.mark.slow
def test_same_seed_gives_bit_identical_weights(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        assert train(capsys, tmp_path / name, *CPU, "--epochs", "1", "--seed", seed)[0] == 0
    a, b, c = (load_file(str(tmp_path / n / "model.safetensors")) for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_linear_recipe(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, stdout, _ = train(capsys, tmp_path / "lin", *CPU, "--recipe", "linear", "--epochs", "1")
    assert code == 0 and "accuracy" not in stdout
    weights = load_file(str(tmp_path / "lin" / "model.safetensors"))
    assert weights["weight"].shape == (1, 10)


@pytest.mark.slow
def test_cifar_recipe_on_synthetic_data(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = (*CPU, "--recipe", "cifar10-resnet18", "--synthetic", "40", "--epochs", "1")
    code, _, _ = train(capsys, tmp_path / "syn", *argv, "--batch-size", "8", "--cifar-stem")
    assert code == 0
    weights = load_file(str(tmp_path / "syn" / "model.safetensors"))
    assert weights["conv1.weight"].shape == (64, 3, 3, 3)
    assert weights["fc.weight"].shape == (10, 512)


@pytest.mark.slow
def test_cifar_recipe_from_a_data_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    write_fake_cifar_batches(tmp_path / "cifar", n_per_batch=8)
    argv = (*CPU, "--recipe", "cifar10-resnet18", "--data-dir", str(tmp_path / "cifar"))
    code, _, _ = train(capsys, tmp_path / "dir", *argv, "--epochs", "1", "--batch-size", "16")
    assert code == 0
    assert (tmp_path / "dir" / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--recipe", "nope"], "valid recipes: digits, linear, cifar10-resnet18"),
        (["--strategy", "nope"], "valid strategies: auto, cpu, cuda"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--batch-size", "-3"], "--batch-size must be at least 1"),
        (["--lr", "0"], "--lr must be a positive number"),
        (["--precision", "fp8"], "valid precisions"),
        (["--devices", "0"], "must be at least 1"),
        (["--synthetic", "10"], "uses its own data"),
        (["--strategy", "cpu", "--sync-batchnorm"], "use --strategy ddp or drop --sync-batchnorm"),
        (["--recipe", "cifar10-resnet18"], "--data-dir DIR"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--epochs", "x"], "invalid int value"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    code, _, err = train(capsys, tmp_path / "bad", *argv)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "bad").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("strategy", ["cuda", "mps"])
def test_missing_accelerator_suggests_auto_or_cpu(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, strategy: str
) -> None:
    if strategy == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    code, _, err = train(capsys, tmp_path / "x", "--strategy", strategy)
    assert code == 2
    assert "use --strategy auto or cpu" in err


def test_missing_cifar_files_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    argv = (*CPU, "--recipe", "cifar10-resnet18", "--data-dir", str(tmp_path / "empty"))
    code, _, err = train(capsys, tmp_path / "out", *argv)
    assert code == 2
    assert "data_batch_1" in err and "test_batch" in err and "Traceback" not in err


@pytest.mark.slow
def test_finished_run_is_not_overwritten_without_overwrite(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--strategy cpu`: `--overwrite` leaves nothing of the previous run (its profile,
    TensorBoard events, checkpoints, an export, a crashed write's leftover) and keeps every
    file of the user's, also inside paratrain's folders."""
    out = tmp_path / "run"
    linear = (*CPU, "--recipe", "linear", "--epochs", "1")
    first = (*linear, "--profile", "1", "--tensorboard", "--save-every", "2")
    assert train(capsys, out, *first)[0] == 0
    old_trace = next((out / "profile").glob("rank0.*.pt.trace.json"))
    old_events = next((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(list((out / "checkpoints").iterdir())) > 1
    (out / "model-int8.pt").write_bytes(b"exported")  # as `paratrain export` names it
    (out / ".config.json.k3j_a8x2.tmp").write_text("{")  # a write cut short
    mine = ["notes.txt", "model-best.pt", ".config.json.bak", "checkpoints/notes.txt"]
    mine += ["tensorboard/other/events.out.tfevents.1"]  # profile/ holds only paratrain's
    for name in mine:
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    code, _, err = train(capsys, out, *linear, "--seed", "3")
    assert code == 2 and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    code, _, _ = train(capsys, out, *linear, "--seed", "3", "--max-steps", "1", "--overwrite")
    assert code == 0
    assert all((out / name).read_text() == "mine" for name in mine)
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    kept = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    new_run = {"config.json", "metrics.jsonl", "timings.jsonl", "model.safetensors"}
    assert kept == new_run | set(mine) | {"checkpoints/step-000001/" + n for n in CKPT}
    assert not old_trace.exists() and not old_events.exists()
    assert not (out / "profile").exists()  # a folder of paratrain's goes once empty


def test_overwrite_clears_traces_left_where_no_run_is_recognised(tmp_path: Path) -> None:
    """Without config.json and the rest (removed by hand), --overwrite still removes the old
    run's traces and events; without --overwrite nothing is touched. No training: in process."""
    from paratrain.training.rundir import prepare

    names = ["profile/rank0.1764100000000000000.pt.trace.json", "model-int4.pt"]
    names += ["tensorboard/events.out.tfevents.1764100000.host.42.0"]
    for name in [*names, "profile/notes.txt"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x")
    assert prepare(tmp_path, "linear", overwrite=False) == tmp_path
    assert all((tmp_path / name).exists() for name in names)
    prepare(tmp_path, "linear", overwrite=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "profile",
        "profile/notes.txt",
    ]


#: the files of one checkpoint (single process)
CKPT = ("manifest.json", "model.safetensors", "optimizer.pt", "rng-rank0.pt", "state.json")


def test_out_that_is_a_file_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("keep")
    code, _, err = train(capsys, target)
    assert code == 2 and "is a file" in err
    assert target.read_text() == "keep"


@pytest.mark.slow
def test_console_script_and_module_entry_points(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = run_paratrain("train", "--strategy", "nope", env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("paratrain: error: unknown strategy")
    assert "Traceback" not in result.stderr
