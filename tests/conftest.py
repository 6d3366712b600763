"""Shared fixtures: a clean environment and process group around every test, and the CLI
run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from paratrain.data.cifar_cache import CACHE_VARIABLE

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_process_state() -> Iterator[None]:
    """Restore environment variables and destroy any process group a test left behind."""
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True, scope="session")
def private_data_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Decoded CIFAR caches go to the test session's own folder, not the user's."""
    os.environ[CACHE_VARIABLE] = str(tmp_path_factory.mktemp("data-cache"))


def subprocess_env(**extra: str) -> dict[str, str]:
    """The test's environment for a child process: no launcher variables, one thread each
    (two cores shared by several processes), plus ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        and (not key.startswith("PARATRAIN_") or key == CACHE_VARIABLE)
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


CLI = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def paratrain_cli(tmp_path: Path) -> CLI:
    """``paratrain_cli("train", "--strategy", "ddp", ...)`` runs ``python -m paratrain ...``
    in ``tmp_path`` and returns the finished process (stdout and stderr as text)."""

    def run(
        *args: str, env: dict[str, str] | None = None, timeout: float = 240
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "paratrain", *args],
            cwd=tmp_path,
            env=env or subprocess_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run
