"""`paratrain ckpt inspect` and `paratrain ckpt convert`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import cpu_data_parallel
from helpers.cli import main_in_process
from safetensors.torch import load_file
from torch import nn

from paratrain.checkpoints.weights import save_weights
from paratrain.training import rundir

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Run:
    def run(*argv: Any) -> tuple[int, str, str]:
        return main_in_process(capsys, *argv)

    return run


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def deep() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(15)])  # 30 tensors


def assert_plain_copy(written: dict[str, torch.Tensor], model: nn.Module) -> None:
    expected = model.state_dict()
    assert sorted(written) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(written[key], tensor), key


# -- convert ---------------------------------------------------------------------------------


def test_convert_dataparallel_pt_to_plain_safetensors(tmp_path: Path, cli: Run) -> None:
    model = net()
    torch.save(cpu_data_parallel(model).state_dict(), tmp_path / "dp.pt")
    code, out, err = cli("ckpt", "convert", tmp_path / "dp.pt", tmp_path / "plain.safetensors")
    assert (code, err) == (0, "")
    assert "9 tensors" in out and "removed prefixes: module." in out
    assert_plain_copy(load_file(str(tmp_path / "plain.safetensors")), model)


def test_convert_lightning_checkpoint_to_pt_with_strip_prefix(tmp_path: Path, cli: Run) -> None:
    model = net()
    state = {f"model.{k}": v for k, v in cpu_data_parallel(model).state_dict().items()}
    ckpt = {"state_dict": state, "epoch": 3, "optimizer_states": [{"state": {}}]}
    torch.save(ckpt, tmp_path / "last.ckpt")
    dst = tmp_path / "weights.pt"
    code, out, _ = cli("ckpt", "convert", tmp_path / "last.ckpt", dst, "--strip-prefix", "model.")
    assert code == 0
    assert "not written (not weights): optimizer_states" in out
    assert_plain_copy(torch.load(dst, weights_only=True), model)


def test_convert_names_a_prefix_that_is_not_there(tmp_path: Path, cli: Run) -> None:
    save_weights(net(), tmp_path / "model.safetensors")
    code, _, err = cli(
        "ckpt", "convert", tmp_path, tmp_path / "out.safetensors", "--strip-prefix", "encoder"
    )
    assert code == 2 and "no key of" in err and "starts with 'encoder.'" in err
    assert not (tmp_path / "out.safetensors").exists()


def test_convert_refuses_to_overwrite_unless_asked(tmp_path: Path, cli: Run) -> None:
    save_weights(net(), tmp_path / "model.safetensors")
    dst = tmp_path / "keep.safetensors"
    dst.write_bytes(b"precious")
    code, out, err = cli("ckpt", "convert", tmp_path / "model.safetensors", dst)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"paratrain: error: {dst} already exists; pass --overwrite to replace it"
    ]
    assert dst.read_bytes() == b"precious"

    code, _, _ = cli("ckpt", "convert", tmp_path / "model.safetensors", dst, "--overwrite")
    assert code == 0
    assert_plain_copy(load_file(str(dst)), net())


def test_convert_wants_a_known_suffix(tmp_path: Path, cli: Run) -> None:
    save_weights(net(), tmp_path / "model.safetensors")
    code, _, err = cli("ckpt", "convert", tmp_path / "model.safetensors", tmp_path / "out.npz")
    assert code == 2 and "end it with .safetensors" in err
    assert not (tmp_path / "out.npz").exists()


def test_ckpt_without_an_action_is_a_usage_error(cli: Run) -> None:
    code, _, err = cli("ckpt")
    assert code == 2 and err.startswith("paratrain: error: ") and len(err.splitlines()) == 1


# -- inspect ---------------------------------------------------------------------------------


def test_inspect_lists_tensors_sizes_and_prefixes(tmp_path: Path, cli: Run) -> None:
    torch.save(cpu_data_parallel(net()).state_dict(), tmp_path / "dp.pt")
    code, out, err = cli("ckpt", "inspect", tmp_path / "dp.pt")
    assert (code, err) == (0, "")
    # 3x4 + 4, then BatchNorm 4 x 4 + 1 (its counter), then 4x2 + 2: 43 values
    assert "tensors: 9 (float32 x8, int64 x1); 43 values" in out
    assert "prefixes: module. (9 of 9 keys)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("module.")}
    assert "(4, 3)" in rows["module.0.weight"] and "float32" in rows["module.0.weight"]
    assert "scalar" in rows["module.1.num_batches_tracked"] and "int64" in out
    assert "hint: saved from a wrapped model (module.)" in out


def test_inspect_cuts_long_lists_unless_all(tmp_path: Path, cli: Run) -> None:
    save_weights(deep(), tmp_path / "deep.safetensors")
    _, out, _ = cli("ckpt", "inspect", tmp_path / "deep.safetensors")
    assert "... 10 more tensors (--all lists every one)" in out
    _, out_all, _ = cli("ckpt", "inspect", tmp_path / "deep.safetensors", "--all")
    names = deep().state_dict()
    assert all(f"\n{name} " in out_all for name in names)
    assert sum(f"\n{name} " in out for name in names) == 20
    assert "more tensors" not in out_all


def test_inspect_json_of_a_training_checkpoint(tmp_path: Path, cli: Run) -> None:
    step = tmp_path / "run" / "checkpoints" / "step-000012"
    step.mkdir(parents=True)
    save_weights(deep(), step / "model.safetensors")
    torch.save({"state": {}, "param_groups": []}, step / "optimizer.pt")
    state = {"epoch": 1, "step": 12, "world_size": 2, "strategy": "ddp"}
    (step / "state.json").write_text(json.dumps(state))

    code, out, _ = cli("ckpt", "inspect", step, "--json")
    assert code == 0
    report = json.loads(out)
    tensors = deep().state_dict()
    assert report["count"] == len(report["tensors"]) == len(tensors) == 30
    assert report["parameters"] == sum(t.numel() for t in tensors.values()) == 90
    assert report["bytes"] == 90 * 4 and report["dtypes"] == {"float32": 30}
    assert report["file"] == str(step / "model.safetensors")
    assert report["training_state"] == state
    assert report["prefixes"] == {}
    first = next(t for t in report["tensors"] if t["name"] == "0.weight")
    assert first == {
        "name": "0.weight",
        "shape": [2, 2],
        "dtype": "float32",
        "numel": 4,
        "bytes": 16,
    }

    _, text, _ = cli("ckpt", "inspect", step)
    assert "training state: epoch 1, step 12, world size 2, strategy ddp" in text

    code, _, err = cli("ckpt", "inspect", tmp_path / "run")  # an unfinished run: no weights yet
    assert code == 2 and f"its latest checkpoint is {step}: pass that" in err
    save_weights(deep(), tmp_path / "run" / "model.safetensors")
    _, out, _ = cli("ckpt", "inspect", tmp_path / "run", "--json")
    assert json.loads(out)["latest_checkpoint"] == str(step)


def test_inspect_json_shows_lightning_prefix_and_state(tmp_path: Path, cli: Run) -> None:
    state = {f"model.{k}": v for k, v in net().state_dict().items()}
    torch.save({"state_dict": state, "epoch": 5, "global_step": 77}, tmp_path / "last.ckpt")
    code, out, _ = cli("ckpt", "inspect", tmp_path / "last.ckpt", "--json")
    report = json.loads(out)
    assert code == 0 and report["location"] == "['state_dict']"
    assert report["prefixes"] == {"model.": 9}
    assert report["training_state"] == {"epoch": 5, "global_step": 77}
    assert any("--strip-prefix model." in hint for hint in report["hints"])


def test_inspect_a_real_run_directory(tmp_path: Path, cli: Run) -> None:
    out_dir = tmp_path / "run"
    code, _, _ = cli(
        "train", "--recipe", "linear", "--strategy", "cpu", "--epochs", "1", "--max-steps", "2",
        "--no-progress", "--out", out_dir,
    )  # fmt: skip
    assert code == 0 and (out_dir / rundir.WEIGHTS).is_file()
    code, out, _ = cli("ckpt", "inspect", out_dir, "--json")
    report = json.loads(out)
    assert code == 0 and report["format"] == "safetensors"
    assert {t["name"] for t in report["tensors"]} == {"weight", "bias"}
    assert report["training_state"]["status"] == "finished"
    assert report["training_state"]["step"] == 2
    assert report["training_state"]["world_size"] == 1


@pytest.mark.slow
def test_errors_are_one_line_from_a_real_process(tmp_path: Path, paratrain_cli: Any) -> None:
    bad = tmp_path / "broken.pt"
    torch.save(net().state_dict(), bad)
    bad.write_bytes(bad.read_bytes()[:300])
    done = paratrain_cli("ckpt", "inspect", str(bad))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"paratrain: error: {bad} is truncated or corrupted: not a complete torch.save "
        "archive (File is not a zip file)"
    ]
