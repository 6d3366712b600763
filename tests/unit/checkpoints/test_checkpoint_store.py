"""Checkpoint directories and their manifests (paratrain.checkpoints.state.store, .manifest)
as functions over a temporary folder: no model, no training, no process (`--strategy cpu`
writes them this way). test_checkpoint_integrity.py and test_crash_safety.py go through
training runs; these pin each rule: names, order, pruning, leftovers, messages."""

from __future__ import annotations

import errno
import hashlib
import json
import re
from pathlib import Path

import pytest

from paratrain.checkpoints.state import manifest
from paratrain.checkpoints.state.manifest import Damaged, verify
from paratrain.checkpoints.state.store import (
    _os_error,
    checkpoint_name,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    remove_checkpoints,
    remove_leftovers,
    write_checkpoint,
)
from paratrain.utils.atomic import no_space
from paratrain.utils.errors import UserError


def _files(step: int) -> dict[str, manifest.Any]:
    return {
        "model.safetensors": lambda p: p.write_bytes(b"w" * step),
        "state.json": lambda p: p.write_text(json.dumps({"step": step})),
    }


def _save(run: Path, step: int, keep: int = 10) -> Path:
    return write_checkpoint(run, step, _files(step), keep)


def test_a_run_folder_that_does_not_exist_yet_is_made(tmp_path: Path) -> None:
    assert _save(tmp_path / "runs" / "first", 1).is_dir()


def test_names_and_steps() -> None:
    assert checkpoint_name(7) == "step-000007"
    assert checkpoint_name(1234567) == "step-1234567"
    assert checkpoint_step(Path("r/step-000123")) == 123
    for other in (".step-000001.tmp", "step-1x", "xstep-1", "step-"):
        assert checkpoint_step(Path(other)) is None


def test_a_checkpoint_is_its_files_and_a_manifest_and_nothing_else(tmp_path: Path) -> None:
    final = _save(tmp_path, 3)
    assert final == tmp_path / "checkpoints" / "step-000003"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000003"]
    assert sorted(p.name for p in final.iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "state.json",
    ]
    text = (final / "manifest.json").read_text()
    assert text.startswith('{\n  "files": {\n') and text.endswith("}\n")  # sorted, for people
    written = json.loads(text)
    assert written["format"] == 1 and written["step"] == 3
    assert written["files"]["model.safetensors"] == {
        "size": 3,
        "blake2b": hashlib.blake2b(b"www", digest_size=16).hexdigest(),
    }
    assert list(written["files"]) == ["model.safetensors", "state.json"]
    assert verify(final, 3) == written


def test_listing_is_by_step_and_skips_what_is_not_complete(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path) == [] and latest_checkpoint(tmp_path) is None
    for step in (10, 9, 100):
        _save(tmp_path, step)
    root = tmp_path / "checkpoints"
    (root / "step-000200").mkdir()  # neither state.json nor a manifest: incomplete
    (root / "step-000300").write_text("a file")
    only_manifest = root / "step-000050"
    only_manifest.mkdir()
    (only_manifest / "manifest.json").write_text("{}")
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step-000009", "step-000010", "step-000050", "step-000100"]
    assert latest_checkpoint(tmp_path) == root / "step-000100"


def test_only_the_newest_are_kept(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
    _save(tmp_path, 4, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000004"]


def test_saving_a_step_again_replaces_it_whole(tmp_path: Path) -> None:
    first = _save(tmp_path, 5)
    (first / "stale.txt").write_text("from the first save")
    again = write_checkpoint(tmp_path, 5, {"state.json": lambda p: p.write_text('{"step": 5}')}, 3)
    assert sorted(p.name for p in again.iterdir()) == ["manifest.json", "state.json"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000005"]
    shutil_file = tmp_path / "checkpoints" / "step-000006"
    shutil_file.write_text("a file where the checkpoint goes")
    assert _save(tmp_path, 6).is_dir()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000005",
        "step-000006",
    ]


def test_leftovers_of_an_interrupted_save_are_removed_and_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    for name in (".step-000001.tmp", ".step-000002.old"):
        (root / name).mkdir()
        (root / name / "model.safetensors").write_text("half")
    (root / ".step-000003.old").write_text("a file")
    for name in (".step-x.tmp", "notes.txt", ".step-000004.bak"):
        (root / name).write_text("not ours")
    remove_leftovers(root)
    assert sorted(p.name for p in root.iterdir()) == [
        ".step-000004.bak",
        ".step-x.tmp",
        "notes.txt",
    ]
    remove_leftovers(tmp_path / "none")  # no folder: nothing to do


def test_a_failed_write_leaves_nothing_and_says_why(tmp_path: Path) -> None:
    _save(tmp_path, 1)

    def full(path: Path) -> None:
        path.write_bytes(b"x" * 7)
        raise OSError(errno.ENOSPC, "No space left on device")

    files = {"state.json": _files(2)["state.json"], "model.safetensors": full}
    with pytest.raises(UserError) as raised:
        write_checkpoint(tmp_path, 2, files, 3)
    final = tmp_path / "checkpoints" / "step-000002"
    said = str(raised.value)  # the checkpoint, not its temporary folder; what was written
    assert said.startswith(f"no space left on device while writing checkpoint {final}: ")
    assert ".step-000002.tmp" not in said and "bytes free are needed; " in said
    assert "the newest checkpoint, step-000001, is intact" in said and "--out" in said
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]
    with pytest.raises(UserError, match=r"step-000002: 4,611,686,018,427,387,904 bytes needed"):
        write_checkpoint(tmp_path, 2, _files(2), 3, size=1 << 62)

    def denied(path: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(UserError) as raised:
        write_checkpoint(tmp_path, 2, {"model.safetensors": denied}, 3)
    assert str(raised.value) == f"cannot write {final}: Permission denied"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]


def test_os_error_messages(tmp_path: Path) -> None:
    where = tmp_path / "checkpoints" / "step-000002"
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    said = _os_error(quota, where, size=None, written=0)
    assert said.startswith(f"disk quota exceeded while writing checkpoint {where}: ")
    assert re.search(r": [\d,]+ free on the disk, but the quota is exceeded; ", said)
    assert (
        "exceeded; no checkpoint of this run is complete yet: free space under your quota on "
        "that disk (or have the quota raised) and train again" in said
    )
    assert said.endswith(", or train with --out on another disk")
    _save(tmp_path, 1)
    before = no_space(where, 2048, free=100)  # the free space checked before writing
    said = _os_error(before, where, size=2048)
    assert f"{where}: 2,048 bytes needed, 100 free; the newest checkpoint, step-000001" in said
    assert f"is intact: free space on that disk and --resume {tmp_path}, or train" in said
    for error in (OSError(errno.ENOSPC, "No space left on device"), OSError()):
        error.errno = errno.ENOSPC  # a bare one has no words of its own
        said = _os_error(error, where, size=2048, written=10)  # the disk filled up meanwhile
        assert re.search(rf"{where}: more than the [\d,]+ bytes free are needed; the", said)
    # a quota: the free space does not show it; what was written, or the estimate, does
    assert "at least 4,096 bytes needed" in _os_error(quota, where, size=2048, written=4096)
    assert "at least 2,048 bytes needed" in _os_error(quota, where, size=2048, written=10)
    denied = OSError(errno.EACCES, "Permission denied")
    assert _os_error(denied, where) == f"cannot write {where}: Permission denied"
    assert _os_error(OSError("plain"), where) == f"cannot write {where}: plain"


def test_removing_every_checkpoint(tmp_path: Path) -> None:
    remove_checkpoints(tmp_path)  # none: nothing to do
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    root = tmp_path / "checkpoints"
    (root / ".step-000003.tmp").mkdir()
    remove_checkpoints(tmp_path)
    assert not root.exists()
    _save(tmp_path, 1)
    (root / "step-000009").write_text("a file of the user's")
    remove_checkpoints(tmp_path)
    assert [p.name for p in root.iterdir()] == ["step-000009"]


def test_checksums_read_large_files_whole(tmp_path: Path) -> None:
    data = bytes(range(256)) * (3 * 4096 + 7)  # over two chunks
    (tmp_path / "big").write_bytes(data)
    assert manifest.checksum(tmp_path / "big") == hashlib.blake2b(data, digest_size=16).hexdigest()


def _checkpoint(tmp_path: Path, step: int = 4) -> Path:
    return _save(tmp_path, step)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("not json", "is unreadable or not JSON"),
        ("[]", "is not a checkpoint manifest"),
        ('{"step": 4, "files": []}', "is not a checkpoint manifest"),
        ('{"step": "4", "files": {}}', "is not a checkpoint manifest"),
        ('{"files": {}}', "is not a checkpoint manifest"),
    ],
)
def test_an_unreadable_manifest_is_damage(tmp_path: Path, text: str, said: str) -> None:
    checkpoint = _checkpoint(tmp_path)
    (checkpoint / "manifest.json").write_text(text)
    with pytest.raises(Damaged, match=said):
        manifest.read(checkpoint)
    assert manifest.read(tmp_path) is None


def test_verify_names_each_kind_of_damage(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    (checkpoint / ".metadata.json").write_text("{}")  # hidden: someone else's
    assert verify(checkpoint, None)["step"] == 4
    with pytest.raises(Damaged, match=r"holds step 4, not the step of its name \(5\)"):
        verify(checkpoint, 5)
    model = checkpoint / "model.safetensors"
    model.write_bytes(b"wwwww")
    with pytest.raises(Damaged, match=f"{model} has 5 bytes; 4 were written"):
        verify(checkpoint, 4)
    model.write_bytes(b"wwwx")
    with pytest.raises(Damaged, match=f"{model} was altered"):
        verify(checkpoint, 4)


def test_verify_checks_the_step_state_json_says(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    state = checkpoint / "state.json"
    record = json.loads((checkpoint / "manifest.json").read_text())
    for text, said in [('{"step": 5}', "says step 5"), ("[1, 2]", "says step None")]:
        state.write_text(text)
        record["files"]["state.json"] = {
            "size": state.stat().st_size,
            "blake2b": manifest.checksum(state),
        }
        (checkpoint / "manifest.json").write_text(json.dumps(record))
        with pytest.raises(Damaged, match=f"{state} {said}; the manifest says 4"):
            verify(checkpoint, 4)
    # without state.json in the manifest, only the name's step is checked
    del record["files"]["state.json"]
    state.unlink()
    (checkpoint / "manifest.json").write_text(json.dumps(record))
    assert verify(checkpoint, 4)["step"] == 4
