"""Gzipped tar archives built in memory, as a download server would serve them."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path

from paratrain.data.cifar import CIFAR_SUBDIR, write_fake_cifar_batches


def tar_gz(build: Callable[[tarfile.TarFile], None]) -> bytes:
    """The bytes of a ``.tar.gz`` that ``build`` fills."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        build(tar)
    return buffer.getvalue()


def good_archive(tmp: Path) -> bytes:
    """A CIFAR-10 archive of fake batches (four images each), built under ``tmp``."""
    write_fake_cifar_batches(tmp / CIFAR_SUBDIR, n_per_batch=4)
    return tar_gz(lambda tar: tar.add(tmp / CIFAR_SUBDIR, arcname=CIFAR_SUBDIR))
