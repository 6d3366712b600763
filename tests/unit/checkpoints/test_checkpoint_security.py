"""Reading checkpoints never runs pickled code, and damaged files give one clear error."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import main_in_process
from safetensors.torch import save_file
from torch import nn

import paratrain
from paratrain.checkpoints.files import read_checkpoint
from paratrain.checkpoints.weights import save_weights
from paratrain.utils.errors import UserError


class Payload:
    """Unpickling this runs ``os.system`` (creates ``marker``): what a hostile file does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(4, 2).state_dict()


def write_malicious(path: Path, marker: Path, how: str) -> None:
    obj = {"state_dict": weights(), "hyper_parameters": Payload(marker)}
    if how == "torch.save":
        torch.save(obj, path)
    else:  # a bare pickle, as older tools wrote
        with open(path, "wb") as handle:
            pickle.dump(obj, handle, protocol=int(how.split()[-1]))


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return main_in_process(capsys, *argv)


def assert_one_line_error(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("paratrain: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


# -- pickled code ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["torch.save", "pickle protocol 2", "pickle protocol 4"])
def test_a_malicious_pickle_is_refused_and_never_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.pt"
    write_malicious(path, marker, how)

    with pytest.raises(UserError) as caught:
        paratrain.load_weights(nn.Linear(4, 2), path)
    message = str(caught.value)
    assert f"file {path} contains pickled code (GLOBAL " in message
    assert "system" in message  # os.system, spelled posix.system or nt.system
    assert not marker.exists()

    code, _, err = run_cli(capsys, "ckpt", "inspect", str(path))
    assert code == 2
    assert_one_line_error(err, str(path), "pickled code")
    assert not marker.exists()

    # the payload is live: an unrestricted load would have run it
    if how == "torch.save":
        torch.load(path, weights_only=False)
    else:
        pickle.loads(path.read_bytes())  # the point: this runs it
    assert marker.exists()


def test_a_pickled_model_object_is_refused_with_advice(tmp_path: Path) -> None:
    path = tmp_path / "whole-model.pt"
    torch.save(nn.Linear(4, 2), path)
    with pytest.raises(UserError, match=r"pickled code \(GLOBAL torch\.nn\.modules\.linear") as c:
        read_checkpoint(path)
    assert "save model.state_dict()" in str(c.value)


def test_convert_refuses_a_malicious_source_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "payload-ran"
    write_malicious(tmp_path / "evil.ckpt", marker, "torch.save")
    dst = tmp_path / "out.safetensors"
    code, _, err = run_cli(capsys, "ckpt", "convert", str(tmp_path / "evil.ckpt"), str(dst))
    assert code == 2 and "pickled code" in err
    assert not marker.exists() and not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.ckpt"]  # no temp file left


# -- damaged files ---------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def make_damaged(tmp_path: Path, kind: str) -> Path:
    if kind.endswith(".safetensors"):
        path = tmp_path / "model.safetensors"
        save_file(weights(), str(path))
    else:
        path = tmp_path / "model.pt"
        torch.save(weights(), path)
    if kind.startswith("truncated"):
        _truncate(path)
    elif kind.startswith("random"):
        path.write_bytes(os.urandom(4096))
    elif kind.startswith("empty"):
        path.write_bytes(b"")
    return path


DAMAGED = {
    "truncated .pt": "truncated",
    "truncated .safetensors": "truncated",
    "random .pt": "corrupted",
    "random .safetensors": "corrupted",
    "empty .pt": "empty",
    "empty .safetensors": "empty",
}


@pytest.mark.parametrize("kind", list(DAMAGED))
def test_damaged_files_give_a_user_error_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = make_damaged(tmp_path, kind)
    with pytest.raises(UserError) as caught:
        paratrain.load_weights(nn.Linear(4, 2), path)
    message = str(caught.value)
    assert str(path) in message and DAMAGED[kind] in message
    assert "\n" not in message

    code, _, err = run_cli(capsys, "ckpt", "inspect", str(path))
    assert code == 2
    assert_one_line_error(err, str(path), DAMAGED[kind])


def test_a_truncated_legacy_pickle_is_reported_not_raised_raw(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save(weights(), path, _use_new_zipfile_serialization=False)
    _truncate(path)
    with pytest.raises(UserError, match=re.escape(f"{path} is truncated or corrupted")):
        read_checkpoint(path)


def test_the_undamaged_originals_do_load(tmp_path: Path) -> None:
    """The damaged files above were made from files that are fine."""
    save_file(weights(), str(tmp_path / "a.safetensors"))
    torch.save(weights(), tmp_path / "b.pt")
    torch.save(weights(), tmp_path / "c.pt", _use_new_zipfile_serialization=False)
    for name in ("a.safetensors", "b.pt", "c.pt"):
        assert paratrain.load_weights(nn.Linear(4, 2), tmp_path / name).ok


# -- paths -----------------------------------------------------------------------------------


def test_a_missing_path_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere" / "model.safetensors"
    with pytest.raises(UserError, match=re.escape(f"no such file or directory: {missing}")):
        paratrain.load_weights(nn.Linear(4, 2), missing)
    code, _, err = run_cli(capsys, "ckpt", "convert", str(missing), str(tmp_path / "x.pt"))
    assert code == 2
    assert_one_line_error(err, str(missing))


def test_an_unfinished_run_points_at_its_latest_checkpoint(tmp_path: Path) -> None:
    for step in (5, 40, 12):
        directory = tmp_path / "checkpoints" / f"step-{step:06d}"
        directory.mkdir(parents=True)
        save_weights(nn.Linear(4, 2), directory / "model.safetensors")
    with pytest.raises(UserError, match=r"latest checkpoint is .*step-000040: pass that"):
        read_checkpoint(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"holds no model\.safetensors"):
        read_checkpoint(tmp_path / "empty")


def test_a_corrupt_state_json_is_named(tmp_path: Path) -> None:
    save_weights(nn.Linear(4, 2), tmp_path / "model.safetensors")
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'state.json'} is unreadable")):
        read_checkpoint(tmp_path)
