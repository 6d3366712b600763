"""Checkpoints are verified, not trusted, and a full disk is one line: every case on one
small run (`--strategy cpu`, the linear recipe), damaged in a copy, in this process."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import weakref
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest
from helpers.cli import main_in_process

from paratrain.checkpoints.state import manifest
from paratrain.checkpoints.state.store import write_checkpoint
from paratrain.cli.main import main
from paratrain.training.rundir import MetricsWriter
from paratrain.utils import atomic
from paratrain.utils.atomic import atomic_write, atomic_write_text
from paratrain.utils.errors import UserError

CPU = ("--strategy", "cpu")
COMMON = (*CPU, "--recipe", "linear", "--batch-size", "100", "--save-every", "2")


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code, _, err = main_in_process(capsys, "train", "--no-progress", *argv)
    assert "Traceback" not in err
    return code, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("integrity") / "run"
    assert main(["train", "--no-progress", "--out", str(run), *COMMON, "--max-steps", "6"]) == 0
    return run


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes: an exponent bit of a float
    path.write_bytes(bytes(data))


def _set_step(path: Path) -> None:
    text = path.read_text()
    assert '"step": 6,' in text
    path.write_text(text.replace('"step": 6,', '"step": 8,'))  # the same size


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


DAMAGES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "flipped bit": ("model.safetensors", _flip_a_bit, "model.safetensors was altered"),
    "step edited": ("state.json", _set_step, "state.json was altered"),
    "optimizer gone": ("optimizer.pt", Path.unlink, "optimizer.pt is missing"),
    "optimizer a folder": ("optimizer.pt", _directory, "optimizer.pt is not a file"),
    "extra file": ("notes.txt", lambda p: p.write_text("x"), "notes.txt is not in the manifest"),
    "manifest gone": ("manifest.json", Path.unlink, "manifest.json is missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_newest_checkpoint_is_named_with_the_newest_intact_one(
    damage: str, run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name, harm, message = DAMAGES[damage]
    newest = run / "checkpoints" / "step-000006"
    harm(newest / name)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    code, err = _train(capsys, "--resume", str(run), "--max-steps", "8")
    assert code == 2 and err.count("\n") == 1, err
    assert message in err and str(newest) in err
    assert "the newest intact checkpoint is step-000004" in err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # nothing touched
    # Named directly, the damaged checkpoint is refused as well.
    code, err = _train(capsys, "--resume", str(newest), "--max-steps", "8")
    assert code == 2 and message in err
    # Moved aside, the run goes on from the intact one.
    shutil.move(newest, run / "damaged")
    assert _train(capsys, "--resume", str(run), "--max-steps", "8")[0] == 0


def test_a_checkpoint_renamed_to_another_step_is_refused(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = run / "checkpoints"
    (root / "step-000006").rename(root / "step-000007")
    code, err = _train(capsys, "--resume", str(run), "--max-steps", "8")
    assert code == 2 and "holds step 6, not the step of its name (7)" in err


def test_a_checkpoint_without_a_manifest_from_an_older_version_is_read(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Format 1 (before manifests): resumed unverified; its optimizer is still required."""
    newest = run / "checkpoints" / "step-000006"
    (newest / "manifest.json").unlink()
    state = json.loads((newest / "state.json").read_text())
    (newest / "state.json").write_text(json.dumps({**state, "format": 1}))
    (newest / "optimizer.pt").rename(run / "optimizer.pt")
    code, err = _train(capsys, "--resume", str(run), "--max-steps", "8")
    assert code == 2 and "optimizer.pt is missing" in err  # an error, never a fresh optimizer
    (run / "optimizer.pt").rename(newest / "optimizer.pt")
    assert _train(capsys, "--resume", str(run), "--max-steps", "8")[0] == 0


def test_a_file_where_a_checkpoint_goes_is_refused(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newest = run / "checkpoints" / "step-000006"
    shutil.rmtree(newest)
    newest.write_text("not a checkpoint")
    code, err = _train(capsys, "--resume", str(run), "--max-steps", "8")
    assert code == 2 and f"{newest} is not a checkpoint (a file" in err


def _full(exc_errno: int = errno.ENOSPC) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        tmp.write_bytes(b"x" * 100)
        raise OSError(exc_errno, "No space left on device")

    return write


def test_a_full_disk_keeps_the_previous_file_and_says_so(tmp_path: Path) -> None:
    target = tmp_path / "weights.bin"
    atomic_write_text(target, "before")
    with pytest.raises(OSError, match="no space left on device while writing") as caught:
        atomic_write(target, _full())
    assert caught.value.errno == errno.ENOSPC
    # it filled up while written: more than what is free again once the part written goes
    assert re.search(rf"{target}: more than the [\d,]+ bytes free are needed$", str(caught.value))
    assert target.read_text() == "before" and sorted(tmp_path.iterdir()) == [target]
    with pytest.raises(OSError, match=f"{target}: at least 100 bytes needed, ") as caught:
        atomic_write(target, _full(errno.EDQUOT))  # a quota the free space does not show
    assert caught.value.errno == errno.EDQUOT
    assert target.read_text() == "before" and sorted(tmp_path.iterdir()) == [target]
    # the free space checked (size) and yet full: the larger of size and what was written
    with pytest.raises(OSError, match=f"{target}: at least 4,096 bytes needed, "):
        atomic_write(target, _full(errno.EDQUOT), size=4096)
    with pytest.raises(OSError, match=r": more than the [\d,]+ bytes free are needed$"):
        atomic_write(target, _full(), size=4096)
    with pytest.raises(OSError, match=r"1,099,511,627,776 bytes needed, [\d,]+ free"):
        atomic_write(target, _full(), size=1 << 40)  # checked before anything is written
    assert target.read_text() == "before" and sorted(tmp_path.iterdir()) == [target]


def test_a_full_disk_closes_what_the_writer_left_open(tmp_path: Path) -> None:
    """A writer failing with its file open (torch.save's zip writer does): the error, kept,
    must not keep the file, whose space the free figure would otherwise miss."""
    opened: list[weakref.ref[IO[bytes]]] = []

    def write(tmp: Path) -> None:
        handle = open(tmp, "wb")  # noqa: SIM115 - left open, as a failing writer does
        opened.append(weakref.ref(handle))
        handle.write(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="no space left on device") as caught:
        atomic_write(tmp_path / "weights.bin", write)
    assert caught.value.__cause__ is not None  # the writer's error, frames and all, is kept
    assert opened[0]() is None and list(tmp_path.iterdir()) == []


def test_a_full_disk_during_a_checkpoint_leaves_no_part_of_it(tmp_path: Path) -> None:
    ok = {"state.json": lambda tmp: tmp.write_text(json.dumps({"step": 1}))}
    write_checkpoint(tmp_path, 1, ok, keep=3)
    files = {"model.safetensors": _full(), **ok}
    with pytest.raises(UserError, match=r"no space left on device while writing .*step-000002"):
        write_checkpoint(tmp_path, 2, files, keep=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]
    assert manifest.verify(tmp_path / "checkpoints" / "step-000001", 1)["step"] == 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_full_disk_while_appending_metrics_names_the_file(tmp_path: Path) -> None:
    """A real ENOSPC (/dev/full refuses every write): one line naming metrics.jsonl, not a
    bare "No space left on device", and what to do."""
    write_checkpoint(tmp_path, 4, {"state.json": lambda p: p.write_text("{}")}, keep=3)
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 1})
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        os.dup2(full, writer._handle.fileno())  # the file's descriptor now writes there
        with pytest.raises(UserError) as caught:
            writer.write({"step": 2})
    finally:
        os.close(full)
        with contextlib.suppress(OSError):  # the line it still holds cannot be written
            writer.close()
    said = str(caught.value)
    assert said.startswith(f"no space left on device while writing {path}: ")
    assert f"step-000004, is intact: free space on that disk and --resume {tmp_path}, or" in said
    assert writer.lines == 1 and path.read_text() == '{"step": 1}\n'


Usage = namedtuple("Usage", "total used free")


def test_train_on_a_full_disk_is_one_line_and_exit_2(
    run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The free space checked before a checkpoint is written: too little, nothing written."""
    real = shutil.disk_usage

    def usage(path: str | Path) -> Usage:
        total, used, free = real(path)
        return Usage(total, used, 0 if "checkpoints" in str(path) else free)

    monkeypatch.setattr(atomic.shutil, "disk_usage", usage)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    code, err = _train(capsys, "--resume", str(run), "--max-steps", "8")
    assert code == 2 and err.count("\n") == 1
    assert f"while writing checkpoint {run}/checkpoints/step-000008: " in err
    assert " bytes needed, 0 free; the newest checkpoint, step-000006, is intact" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def _full_file(tensors: object, filename: str, metadata: object = None) -> None:
    """safetensors' ``save_file`` on a disk that fills up after the free-space check."""
    Path(filename).write_bytes(b"x" * 100)
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.slow
def test_a_disk_full_while_writing_then_a_resume_after_freeing_space(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--strategy cpu`: a checkpoint, then the final weights, fail half-written; each is one
    line naming the file the user knows (not a temporary one) and what to do, leaves nothing
    behind, and the resume once there is space ends where a run never interrupted ends."""
    from paratrain.checkpoints.state import sharded, snapshot

    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    weights = (run / "model.safetensors").read_bytes()
    with monkeypatch.context() as patch:
        patch.setattr(snapshot, "save_file", _full_file)
        code, err = _train(capsys, "--resume", str(run), "--max-steps", "8")
    assert code == 2 and err.count("\n") == 1 and ".tmp" not in err
    assert err.startswith(
        f"paratrain: error: no space left on device while writing checkpoint "
        f"{run}/checkpoints/step-000008: "
    )
    assert f"step-000006, is intact: free space on that disk and --resume {run}" in err
    assert err.endswith(", or train with --out on another disk\n")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    with monkeypatch.context() as patch:
        patch.setattr(sharded, "save_file", _full_file)
        code, err = _train(capsys, "--resume", str(run), "--max-steps", "8")
    assert code == 2 and err.count("\n") == 1
    assert f"while writing the final weights {run}/model.safetensors: " in err
    assert f"step-000008, is intact: free space on that disk and --resume {run} to" in err
    assert (run / "model.safetensors").read_bytes() == weights  # the previous ones, whole
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".model")) == []
    assert json.loads((run / "config.json").read_text())["status"] == "running"
    assert _train(capsys, "--resume", str(run))[0] == 0  # the space is back
    straight = tmp_path / "straight"
    assert _train(capsys, "--out", str(straight), *COMMON, "--max-steps", "8")[0] == 0
    assert (run / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()


def test_a_full_quota_is_said_as_one(tmp_path: Path) -> None:
    """EDQUOT: the disk has room, the user's quota has not; the line says which."""
    from paratrain.training.rundir import full_disk_said

    with pytest.raises(UserError) as caught, full_disk_said(tmp_path):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    said = str(caught.value)
    assert said.startswith(f"disk quota exceeded while writing the final weights {tmp_path}")
    assert (
        "but the quota is exceeded; the run has no checkpoint: free space under your quota" in said
    )
    assert said.endswith("or train with --out on another disk")
