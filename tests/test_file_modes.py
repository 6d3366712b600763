"""Files paratrain writes get the mode of any new file of the process (0666 less the umask),
so a shared run directory can be read by the others the umask lets in."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env

from paratrain.atomic import atomic_write_text, current_umask


def test_current_umask_reads_without_changing_it() -> None:
    previous = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        assert current_umask() == 0o027  # reading it left it as it was
    finally:
        os.umask(previous)


def test_atomic_write_follows_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        os.umask(0o077)
        atomic_write_text(tmp_path / "b.json", "{}")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o600


def test_every_file_of_a_run_follows_the_umask(tmp_path: Path) -> None:
    """digits on the CPU under umask 027: weights, config, metrics and every checkpoint part
    are 0640, not the temporary file's 0600 nor a fixed 0644."""
    command = [sys.executable, "-m", "paratrain", "train", "--recipe", "digits"]
    command += ["--strategy", "cpu", "--max-steps", "4", "--save-every", "2", "--no-progress"]
    command += ["--out", "run"]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=lambda: os.umask(0o027),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    files = [path for path in (tmp_path / "run").rglob("*") if path.is_file()]
    names = {path.name for path in files}
    assert {"model.safetensors", "config.json", "state.json"} <= names
    modes = {str(path): oct(stat.S_IMODE(path.stat().st_mode)) for path in files}
    assert set(modes.values()) == {"0o640"}, modes
