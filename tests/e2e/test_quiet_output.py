"""Output users can trust and need not clean up after: the summary counts the epochs as they
were, a failed download leaves no empty folders, and the thread count paratrain sets for the
processes it starts is said once (``--strategy cpu``: nothing here starts processes)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from helpers.cli import run_paratrain

from paratrain.cli.main import main
from paratrain.data.download import URL_ENV, download_cifar10
from paratrain.launching.threads import choose_threads, started_note
from paratrain.training.loop import Summary, epochs_text
from paratrain.utils.errors import UserError


@pytest.mark.parametrize(
    "trained, text",
    [
        (50 / 45, "1.1 epochs"),  # digits: 45 steps an epoch
        (2.0, "2 epochs"),
        (1.0, "1 epoch"),
        (5 / 45, "0.1 epochs"),
        (1 / 1000, "0.001 epochs"),
        (None, "3 epochs"),  # not known: the epochs begun
    ],
)
def test_epochs_are_counted_as_they_were(trained: float | None, text: str) -> None:
    assert epochs_text(trained, 3) == text


def test_the_summary_says_a_fraction_of_an_epoch() -> None:
    summary = Summary(2, 50, 1.0, 0.5, 0.5, None, 100.0, epochs_trained=50 / 45)
    assert summary.line(None).startswith("trained 1.1 epochs, 50 steps in 1.0s")


def closed_port() -> int:
    """A port on 127.0.0.1 that nobody listens on: connecting to it is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_failed_download_leaves_no_empty_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(URL_ENV, f"http://127.0.0.1:{closed_port()}/cifar-10-python.tar.gz")
    with pytest.raises(UserError, match="cannot download"):
        download_cifar10(tmp_path / "a" / "b" / "data")
    assert list(tmp_path.iterdir()) == []  # not data, nor the parents it created
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(UserError, match="cannot download"):
        download_cifar10(kept)
    assert kept.is_dir() and list(kept.iterdir()) == []  # a folder the user had stays


def test_train_with_a_failed_download_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(URL_ENV, f"http://127.0.0.1:{closed_port()}/cifar-10-python.tar.gz")
    argv = ["train", "--recipe", "cifar10-resnet18", "--download", "--strategy", "cpu"]
    argv += ["--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratrain: error: cannot download") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # neither --data-dir nor --out


def test_the_threads_set_for_started_processes_are_said_unless_the_user_chose() -> None:
    chosen = choose_threads(cores=8, processes=2)
    note = started_note(chosen, 2)
    assert note is not None and "OMP_NUM_THREADS=4 for each of the 2 process(es)" in note
    assert started_note(choose_threads(8, 2, inherited="3"), 2) is None
    assert started_note(choose_threads(8, 2, requested=2), 2) is None  # --threads


@pytest.mark.slow
def test_a_reader_that_leaves_early_gets_no_error(tmp_path: Path) -> None:
    """`paratrain recipes | head -1`: stdout is a pipe whose reader is gone. No "error:
    Broken pipe", no traceback at exit; exit code 141, as after SIGPIPE."""
    read, write = os.pipe()
    os.close(read)  # every write now fails with EPIPE
    try:
        done = run_paratrain("recipes", stdout=write, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")
