"""CIFAR-10 download: only ever against a local HTTP server on 127.0.0.1 serving fake archives."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers.archives import good_archive
from helpers.archives import tar_gz as _tar

from paratrain.cli.main import main
from paratrain.data.cifar import CIFAR_FILES, CIFAR_SUBDIR, load_cifar10, write_fake_cifar_batches
from paratrain.data.download import (
    CIFAR_MD5,
    CIFAR_URL,
    MD5_ENV,
    URL_ENV,
    default_cache_dir,
    download_cifar10,
    source,
)
from paratrain.utils.errors import UserError


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def traversal_archive(tmp: Path) -> bytes:
    write_fake_cifar_batches(tmp / CIFAR_SUBDIR, n_per_batch=2)

    def build(tar: tarfile.TarFile) -> None:
        tar.add(tmp / CIFAR_SUBDIR, arcname=CIFAR_SUBDIR)
        _add_bytes(tar, f"{CIFAR_SUBDIR}/../../escaped.txt", b"outside")

    return _tar(build)


def symlink_archive(tmp: Path) -> bytes:
    write_fake_cifar_batches(tmp / CIFAR_SUBDIR, n_per_batch=2)

    def build(tar: tarfile.TarFile) -> None:
        tar.add(tmp / CIFAR_SUBDIR, arcname=CIFAR_SUBDIR)
        link = tarfile.TarInfo(f"{CIFAR_SUBDIR}/passwd")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)

    return _tar(build)


class Server:
    """Serves ``files[path]``; a path in ``truncated`` announces more bytes than it sends."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.truncated: set[str] = set()
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.path in server.truncated:
                    body = body[: len(body) // 2]
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def serve(self, path: str, body: bytes, monkeypatch: pytest.MonkeyPatch, md5: str = "") -> None:
        """Point the download at ``path`` serving ``body`` (MD5: its own unless given)."""
        self.files[path] = body
        monkeypatch.setenv(URL_ENV, self.url(path))
        monkeypatch.setenv(MD5_ENV, md5 or hashlib.md5(body).hexdigest())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_download_extracts_checks_and_is_idempotent(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.serve("/c.tar.gz", good_archive(tmp_path / "src"), monkeypatch)
    root = tmp_path / "data"
    found = download_cifar10(root)
    assert found == root / CIFAR_SUBDIR
    assert sorted(p.name for p in found.iterdir()) == sorted(CIFAR_FILES)
    assert _leftovers(root) == [CIFAR_SUBDIR]  # no temporary folder or archive left
    train, test = load_cifar10(root)
    assert len(train) == 20 and len(test) == 4
    assert download_cifar10(root) == found  # a second run finds the files...
    assert server.requests == ["/c.tar.gz"]  # ...and downloads nothing


def test_wrong_checksum_keeps_nothing(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.serve("/c.tar.gz", good_archive(tmp_path / "src"), monkeypatch, md5="0" * 32)
    root = tmp_path / "data"
    with pytest.raises(UserError, match=f"expected {'0' * 32}.*nothing was extracted"):
        download_cifar10(root)
    assert _leftovers(root) == []


def test_truncated_download_keeps_nothing(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = good_archive(tmp_path / "src")
    server.serve("/c.tar.gz", body, monkeypatch)
    server.truncated.add("/c.tar.gz")
    root = tmp_path / "data"
    with pytest.raises(UserError, match=r"stopped after|truncated") as info:
        download_cifar10(root)
    assert "\n" not in str(info.value)
    assert _leftovers(root) == []


@pytest.mark.parametrize(
    "build, message",
    [(traversal_archive, "outside the folder"), (symlink_archive, "is a link")],
)
def test_unsafe_archives_are_refused(
    server: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    build: Callable[[Path], bytes],
    message: str,
) -> None:
    server.serve("/evil.tar.gz", build(tmp_path / "src"), monkeypatch)  # its MD5 matches
    root = tmp_path / "deep" / "data"
    with pytest.raises(UserError, match=message):
        download_cifar10(root)
    assert _leftovers(root) == []
    assert not (tmp_path / "deep" / "escaped.txt").exists()
    assert not (tmp_path / "escaped.txt").exists()


def test_archive_without_batches_is_refused(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = _tar(lambda tar: _add_bytes(tar, "readme.txt", b"not cifar"))
    server.serve("/c.tar.gz", body, monkeypatch)
    with pytest.raises(UserError, match="lacks the CIFAR-10 batches"):
        download_cifar10(tmp_path / "data")
    assert _leftovers(tmp_path / "data") == []


def test_not_a_tar_is_refused(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.serve("/c.tar.gz", b"<html>a login page</html>", monkeypatch)
    with pytest.raises(UserError, match=r"not a valid \.tar\.gz"):
        download_cifar10(tmp_path / "data")


def test_http_error_is_one_line(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(URL_ENV, server.url("/missing.tar.gz"))
    with pytest.raises(UserError, match="HTTP 404"):
        download_cifar10(tmp_path / "data")


def test_defaults_and_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(URL_ENV, raising=False)
    monkeypatch.delenv(MD5_ENV, raising=False)
    assert source() == (CIFAR_URL, CIFAR_MD5)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "paratrain" / "cifar10"
    monkeypatch.setenv(MD5_ENV, "nothex")
    with pytest.raises(UserError, match="not an MD5"):
        source()
    monkeypatch.setenv(MD5_ENV, CIFAR_MD5)
    monkeypatch.setenv(URL_ENV, "ftp://example.invalid/c.tar.gz")
    with pytest.raises(UserError, match="not an http"):
        source()


def test_existing_batches_need_no_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_fake_cifar_batches(tmp_path, n_per_batch=2)
    monkeypatch.setenv(URL_ENV, "ftp://never.used/")  # would be refused if it were read
    assert download_cifar10(tmp_path) == tmp_path


@pytest.mark.slow
def test_train_download_into_the_cache(
    server: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server.serve("/c.tar.gz", good_archive(tmp_path / "src"), monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = ["train", "--recipe", "cifar10-resnet18", "--download", "--cifar-stem", "--epochs", "1"]
    argv += ["--batch-size", "8", "--max-steps", "1", "--strategy", "cpu", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    cached = tmp_path / "cache" / "paratrain" / "cifar10" / CIFAR_SUBDIR
    assert sorted(p.name for p in cached.iterdir()) == sorted(CIFAR_FILES)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["config"]["data_dir"] == str(cached)  # --resume reads the same folder


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--recipe", "digits"], "nothing to download"),
        (["--recipe", "cifar10-resnet18", "--synthetic", "8"], "one of --download and"),
    ],
)
def test_train_download_errors(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--download", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_train_bad_download_exits_2(
    server: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server.serve("/c.tar.gz", good_archive(tmp_path / "src"), monkeypatch, md5="f" * 32)
    argv = ["train", "--recipe", "cifar10-resnet18", "--download", "--strategy", "cpu"]
    code = main([*argv, "--data-dir", str(tmp_path / "d"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "MD5" in err and err.count("\n") == 1
    assert _leftovers(tmp_path / "d") == []
