"""Files paratrain writes get the mode of any new file of the process (0666 less the umask),
so a shared run directory can be read by the others the umask lets in."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
import torch
from helpers.archives import good_archive
from helpers.cli import run_paratrain
from safetensors.torch import save_file

from paratrain.cli.main import main
from paratrain.data.cifar import CIFAR_FILES
from paratrain.data.download import MD5_ENV, URL_ENV, download_cifar10
from paratrain.utils.atomic import atomic_write_text, current_umask

pytestmark = pytest.mark.slow  # real processes, or several layers at work


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
    """digits on the CPU under umask 027: weights, config, metrics, every checkpoint part,
    the TensorBoard events and the profiler trace are 0640, not the temporary file's 0600
    nor a fixed 0644; every folder is 0750."""
    command = ["train", "--recipe", "digits"]
    command += ["--strategy", "cpu", "--max-steps", "4", "--save-every", "2", "--no-progress"]
    command += ["--tensorboard", "--profile", "1", "--out", "run"]
    done = run_paratrain(*command, cwd=tmp_path, preexec_fn=lambda: os.umask(0o027))
    assert done.returncode == 0, done.stderr[-2000:]
    files = [path for path in (tmp_path / "run").rglob("*") if path.is_file()]
    names = {path.name for path in files}
    assert {"model.safetensors", "config.json", "state.json", "metrics.jsonl"} <= names
    assert any(name.startswith("events.out.tfevents") for name in names)
    assert any(name.endswith(".pt.trace.json") for name in names)
    modes = {str(path): oct(stat.S_IMODE(path.stat().st_mode)) for path in files}
    assert set(modes.values()) == {"0o640"}, modes
    folders = [tmp_path / "run", *(p for p in (tmp_path / "run").rglob("*") if p.is_dir())]
    assert {"checkpoints", "tensorboard", "profile"} <= {p.name for p in folders}
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in folders} == {"0o750"}


def test_converted_weights_and_downloaded_data_follow_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`paratrain ckpt convert` (both formats) and CIFAR-10 extracted from an archive whose
    members are 0644 and 0755: under umask 027 all are 0640 (folders 0750)."""
    source = tmp_path / "w.safetensors"
    save_file({"weight": torch.ones(2)}, str(source))
    archive = tmp_path / "cifar.tar.gz"
    archive.write_bytes(good_archive(tmp_path / "src"))
    monkeypatch.setenv(URL_ENV, archive.as_uri())
    monkeypatch.setenv(MD5_ENV, hashlib.md5(archive.read_bytes()).hexdigest())
    previous = os.umask(0o027)
    try:
        for name in ("w.pt", "w2.safetensors"):
            assert (
                main(["ckpt", "convert", str(source), "--out", str(tmp_path / "out" / name)]) == 0
            )
        data = download_cifar10(tmp_path / "data")
    finally:
        os.umask(previous)
    written = [*(tmp_path / "out").iterdir(), *data.iterdir()]
    assert len(written) == 2 + len(CIFAR_FILES)
    assert {oct(stat.S_IMODE(path.stat().st_mode)) for path in written} == {"0o640"}
    assert oct(stat.S_IMODE(data.stat().st_mode)) == "0o750"
