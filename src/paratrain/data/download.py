"""Fetch the official CIFAR-10 python archive once, check it, and extract it safely.

The archive is streamed to a temporary file beside the destination, its MD5 compared with
the published one, every member checked (plain files and folders only, every path inside
the destination), then extracted into a temporary folder that is renamed into place. So
the destination holds the complete batches or nothing, and a second run finds them and
downloads nothing.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from paratrain.data.cifar import CIFAR_FILES, CIFAR_SUBDIR
from paratrain.utils import environment
from paratrain.utils.atomic import current_umask
from paratrain.utils.errors import UserError

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"
URL_ENV = "PARATRAIN_CIFAR_URL"
MD5_ENV = "PARATRAIN_CIFAR_MD5"
_CHUNK = 1 << 20
_SCHEMES = ("http", "https", "file")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/paratrain/cifar10``, or ``~/.cache/paratrain/cifar10``."""
    return environment.current().cache_home().expanduser() / "paratrain" / "cifar10"


def source() -> tuple[str, str]:
    """(URL, MD5) of the archive: the official ones unless the environment overrides them."""
    env = environment.current()
    url = env.get(URL_ENV) or CIFAR_URL
    md5 = (env.get(MD5_ENV) or CIFAR_MD5).strip().lower()
    scheme = url.split(":", 1)[0].lower()
    if scheme not in _SCHEMES:
        raise UserError(f"{URL_ENV}={url} is not an http(s):// or file:// address")
    if not re.fullmatch(r"[0-9a-f]{32}", md5):
        raise UserError(f"{MD5_ENV}={md5} is not an MD5 (32 hexadecimal digits)")
    return url, md5


def batches_in(directory: Path) -> Path | None:
    """The folder holding all six CIFAR-10 batch files: ``directory`` or its subfolder."""
    for candidate in (directory, directory / CIFAR_SUBDIR):
        if all((candidate / name).is_file() for name in CIFAR_FILES):
            return candidate
    return None


def download_cifar10(
    data_dir: str | Path | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """The folder with the CIFAR-10 python batches, downloaded into ``data_dir`` (default:
    :func:`default_cache_dir`) unless they are there already. Raises ``UserError``."""
    root = Path(data_dir).expanduser() if data_dir is not None else default_cache_dir()
    found = batches_in(root)
    if found is not None:
        return found
    url, md5 = source()
    target = root / CIFAR_SUBDIR
    if target.exists():
        raise UserError(
            f"{target} exists but lacks some of {', '.join(CIFAR_FILES)}; remove it and "
            "run again to download CIFAR-10 afresh"
        )
    created = _missing_folders(root)  # removed again if the download fails
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the CIFAR-10 folder {root}: {exc.strerror}") from None
    if log is not None:
        log(f"downloading CIFAR-10 from {url} into {root}")
    try:
        return _download_into(root, target, url, md5)
    except BaseException:
        _remove_if_empty(created)
        raise


def _missing_folders(root: Path) -> list[Path]:
    """``root`` and those of its parents that do not exist yet, deepest first."""
    missing: list[Path] = []
    folder = root.absolute()
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_if_empty(folders: list[Path]) -> None:
    """A failed download leaves no empty folder behind (one that gained files stays)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _download_into(root: Path, target: Path, url: str, md5: str) -> Path:
    """Fetch, check and extract the archive into ``target``; the folder of the batches."""
    # The temporary folder sits beside the target so that the final rename stays on one
    # filesystem (atomic), and it goes away whatever happens.
    with tempfile.TemporaryDirectory(prefix=".cifar10-download-", dir=root) as tmp:
        archive = Path(tmp) / "cifar-10-python.tar.gz"
        digest = _fetch(url, archive)
        if digest != md5:
            raise UserError(
                f"the download from {url} has MD5 {digest}, expected {md5}: it is corrupted "
                f"or not the official archive; nothing was extracted (mirrors: set {MD5_ENV})"
            )
        staging = Path(tmp) / "extract"
        safe_extract(archive, staging)
        extracted = batches_in(staging)
        if extracted is None:
            raise UserError(
                f"the archive from {url} lacks the CIFAR-10 batches ({', '.join(CIFAR_FILES)} "
                f"in {CIFAR_SUBDIR}/); nothing was kept"
            )
        try:
            os.replace(extracted, target)
        except OSError:
            if batches_in(target) is None:  # not another process that finished first
                raise
    found = batches_in(root)
    assert found is not None
    return found


def _fetch(url: str, path: Path) -> str:
    """Stream ``url`` into ``path``; return the MD5 of what arrived. A short read is an error."""
    digest = hashlib.md5(usedforsecurity=False)
    received = 0
    expected: int | None = None
    try:
        with urllib.request.urlopen(url, timeout=60) as response, path.open("wb") as out:
            length = response.headers.get("Content-Length")
            expected = int(length) if length and length.isdigit() else None
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                received += len(chunk)
    except urllib.error.HTTPError as exc:
        raise UserError(f"cannot download {url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise UserError(f"cannot download {url}: {exc.reason}") from None
    except (OSError, ValueError) as exc:
        # http.client.IncompleteRead, a reset connection, a timeout, a full disk...
        raise UserError(
            f"the download from {url} stopped after {received:,} bytes "
            f"({type(exc).__name__}); run again"
        ) from None
    if expected is not None and received != expected:
        raise UserError(
            f"the download from {url} is truncated: {received:,} of {expected:,} bytes; run again"
        )
    return digest.hexdigest()


def check_member(member: tarfile.TarInfo, archive: Path) -> None:
    """Refuse anything but plain files and folders whose path stays inside the destination."""
    name = member.name
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or ".." in parts:
        raise UserError(
            f"refusing {archive.name}: member {name!r} would be written outside the folder; "
            "nothing was extracted"
        )
    if not (member.isfile() or member.isdir()):
        kind = "a link" if member.issym() or member.islnk() else "a device or special file"
        raise UserError(
            f"refusing {archive.name}: member {name!r} is {kind} (only files and folders "
            "are extracted); nothing was extracted"
        )


def _data_within_umask(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    """tarfile's "data" filter, and the modes the umask allows (as for any file paratrain
    writes), not the archive's: a umask of 027 keeps the data from other users."""
    filtered = tarfile.data_filter(member, path)
    if filtered is None or filtered.mode is None:
        return filtered
    return filtered.replace(mode=filtered.mode & ~current_umask(), deep=False)


def safe_extract(archive: Path, destination: Path) -> None:
    """Extract ``archive`` (.tar.gz) into ``destination`` after checking every member."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()  # reads the whole archive: checks come before writes
            for member in members:
                check_member(member, archive)
            destination.mkdir(parents=True)
            # The "data" filter repeats the checks where Python has it (3.10.12+, 3.11.4+).
            if hasattr(tarfile, "data_filter"):
                tar.extractall(destination, members=members, filter=_data_within_umask)
            else:  # pragma: no cover - older Pythons: the checks above are all there is
                tar.extractall(destination, members=members)
    except UserError:
        shutil.rmtree(destination, ignore_errors=True)
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        shutil.rmtree(destination, ignore_errors=True)
        raise UserError(
            f"{archive.name} is not a valid .tar.gz ({type(exc).__name__}: {exc}); "
            "nothing was extracted"
        ) from None
