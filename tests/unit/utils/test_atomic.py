"""Crash-safe writes: a write that fails half-way leaves the previous file whole.

``model.safetensors``, ``config.json`` (which ``--resume RUN`` reads) and ``ckpt convert``
output go through ``atomic_write``: written beside their final name, then renamed over it.
In-process, ``--strategy`` does not apply (no devices).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from paratrain.utils.atomic import atomic_write, atomic_write_text, fsync_dir

OLD = "the previous, complete file\n"


class WriteFailed(Exception):
    pass


def _previous(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(OLD, encoding="utf-8")
    return path


def _half_written(error: BaseException) -> object:
    def write(tmp: Path) -> None:
        tmp.write_text("half of the new fi", encoding="utf-8")
        raise error

    return write


@pytest.mark.parametrize(
    "error",
    [
        WriteFailed("the writer failed"),
        OSError(errno.EIO, "Input/output error"),
        KeyboardInterrupt(),  # Ctrl-C mid-write
    ],
    ids=["exception", "oserror", "interrupt"],
)
def test_a_write_failing_half_way_leaves_the_previous_file_and_no_litter(
    tmp_path: Path, error: BaseException
) -> None:
    path = _previous(tmp_path)
    with pytest.raises(type(error)):
        atomic_write(path, _half_written(error))  # type: ignore[arg-type]
    assert path.read_text(encoding="utf-8") == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_text_that_cannot_be_encoded_leaves_the_previous_file(tmp_path: Path) -> None:
    path = _previous(tmp_path)
    with pytest.raises(UnicodeEncodeError):  # the file is opened, then encoding fails
        atomic_write_text(path, '{"name": "\ud800"}')
    assert path.read_text(encoding="utf-8") == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_the_final_name_holds_the_previous_file_until_the_new_one_is_complete(
    tmp_path: Path,
) -> None:
    path = _previous(tmp_path)
    seen: list[tuple[Path, str]] = []

    def write(tmp: Path) -> None:
        tmp.write_text("new\n", encoding="utf-8")
        seen.append((tmp, path.read_text(encoding="utf-8")))

    atomic_write(path, write)
    ((tmp, during),) = seen
    assert tmp != path and tmp.parent == path.parent  # beside it: the rename is atomic
    assert during == OLD
    assert path.read_text(encoding="utf-8") == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_the_temporary_file_is_hidden_and_names_its_file(tmp_path: Path) -> None:
    """What a hard kill (no cleanup) leaves behind is recognisable: ``.NAME.*.tmp``."""
    names: list[str] = []
    atomic_write(tmp_path / "model.safetensors", lambda tmp: names.append(tmp.name))
    (name,) = names
    assert name.startswith(".model.safetensors.") and name.endswith(".tmp")


def test_a_writer_that_removed_its_file_keeps_its_own_error(tmp_path: Path) -> None:
    path = _previous(tmp_path)

    def write(tmp: Path) -> None:
        tmp.unlink()
        raise WriteFailed("the writer's own error")

    with pytest.raises(WriteFailed):  # not a FileNotFoundError from the clean-up
        atomic_write(path, write)
    assert path.read_text(encoding="utf-8") == OLD


def test_syncing_a_directory_that_cannot_be_opened_is_skipped(tmp_path: Path) -> None:
    fsync_dir(tmp_path / "missing")  # no error: the rename is done, durability best-effort
