"""The one way tests run paratrain's command line.

In a new process, as a user runs it: :func:`run_paratrain` (to its end) and
:func:`start_paratrain` (left running, for tests that signal, kill or watch it), both
``python -m paratrain ARGS``, or ``python -m torch.distributed.run TORCHRUN... -m paratrain
ARGS`` with ``torchrun=``; the child gets :func:`subprocess_env`. In this process:
:func:`main_in_process`, ``main(ARGS)`` and what it printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from paratrain_test_faults import BUSY_VARIABLE

from paratrain.cli.main import main
from paratrain.data.cifar_cache import CACHE_VARIABLE

#: the ``paratrain_cli`` fixture: ``run_paratrain(...)`` run in the test's ``tmp_path``
CLI = Callable[..., "subprocess.CompletedProcess[str]"]

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The test's environment for a child process: no launcher variables, one thread each
    (two cores shared by several processes), plus ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCHER_VARIABLES
        and (not key.startswith("PARATRAIN_") or key in (CACHE_VARIABLE, BUSY_VARIABLE))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def paratrain_command(*args: str | Path, torchrun: Sequence[str] = ()) -> list[str]:
    """``python -m paratrain ARGS``; with ``torchrun`` (its options, e.g. ``("--standalone",
    "--nproc-per-node", "2")``), the same under ``python -m torch.distributed.run``."""
    launcher = ["-m", "torch.distributed.run", *torchrun] if torchrun else []
    return [sys.executable, *launcher, "-m", "paratrain", *map(str, args)]


def run_paratrain(
    *args: str | Path,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    torchrun: Sequence[str] = (),
    **popen: Any,
) -> subprocess.CompletedProcess[str]:
    """Run ``paratrain ARGS`` in a new process to its end: stdout and stderr as text (unless
    ``stdout=``/``stderr=`` say otherwise), ``env`` or :func:`subprocess_env`."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.run(
        paratrain_command(*args, torchrun=torchrun),
        cwd=cwd,
        env=env or subprocess_env(),
        text=True,
        timeout=timeout,
        check=False,
        **streams,
    )


def start_paratrain(
    *args: str | Path,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    torchrun: Sequence[str] = (),
    **popen: Any,
) -> subprocess.Popen[str]:
    """``paratrain ARGS`` started in a new process and left running: stdout and stderr are
    pipes (unless ``stdout=``/``stderr=`` say otherwise); the caller waits for it."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(
        paratrain_command(*args, torchrun=torchrun),
        cwd=cwd,
        env=env or subprocess_env(),
        text=True,
        **streams,
    )


def main_in_process(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """``main(ARGS)`` in this process: its exit code, and what it wrote to stdout and
    stderr."""
    code = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err
