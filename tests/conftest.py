"""Shared fixtures: a clean environment and process group around every test, the CLI run as
a real subprocess, a DataParallel that stays on the CPU, and the device markers.

Tests name the devices they mean (``--strategy cpu``, ``--devices cpu,cpu``): left to
``auto`` or given as a count, devices mean GPUs on a machine that has them. Tests of GPU
behaviour carry a marker and are skipped where the device is absent: ``cuda`` (one CUDA GPU),
``cuda2`` (two) and ``mps``.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

# Before torch is imported: the tests run in two workers side by side (`-n 2`), each of
# whose own runs would otherwise take an OpenMP thread per core and spin on a core the other
# worker holds (the slow tier took 13 minutes that way, 7 with one thread each; 2 cores).
# The processes the tests start get one thread each from subprocess_env.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.distributed as dist
from helpers.cli import CLI, run_paratrain, subprocess_env
from safetensors.torch import load_file
from torch import nn

import paratrain
from paratrain.cli.main import main
from paratrain.data.cifar_cache import CACHE_VARIABLE
from paratrain.models import DigitsCNN

__all__ = ["CLI", "REPO", "cpu_data_parallel", "subprocess_env"]

REPO = Path(__file__).resolve().parent.parent
#: the suite's fault injection plug-in (tests/plugins/paratrain_test_faults.py): on the path
#: of this process and of every process it starts, each of which loads it through its entry
#: point when it first reaches a fault injection point
PLUGINS = Path(__file__).resolve().parent / "plugins"
if str(PLUGINS) not in sys.path:
    sys.path.insert(0, str(PLUGINS))
if str(PLUGINS) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(PLUGINS), *filter(None, [os.environ.get("PYTHONPATH")])]
    )

from paratrain_test_faults import BUSY_VARIABLE  # noqa: E402 (on the path just above)


def missing_device(markers: set[str]) -> str | None:
    """Why a test with these markers cannot run on this machine, or None."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "cuda2" in markers and gpus < 2:
        return f"needs two CUDA GPUs, this machine has {gpus}"
    if "cuda" in markers and gpus < 1:
        return "needs a CUDA GPU"
    if "mps" in markers and not torch.backends.mps.is_available():
        return "needs Apple MPS"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        reason = missing_device({marker.name for marker in item.iter_markers()})
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def cpu_data_parallel(module: nn.Module) -> nn.DataParallel[nn.Module]:
    """A real ``nn.DataParallel`` around ``module``, which stays on the CPU.

    ``nn.DataParallel(module)`` moves ``module`` to cuda:0 on a machine with one GPU; built
    around a module without tensors, it moves nothing, and then holds ``module`` instead.
    Its state dict, and the unwrapping paratrain does, are those of any DataParallel.
    """
    wrapper: nn.DataParallel[nn.Module] = nn.DataParallel(nn.Identity())
    wrapper.module = module
    return wrapper


@pytest.fixture(autouse=True)
def clean_process_state() -> Iterator[None]:
    """Restore environment variables and destroy any process group a test left behind."""
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


# The thread count follows the machine's load when a run starts (launching/threads.py): the
# suite's runs see a quiet machine whatever else runs beside them, so that two runs of one
# test choose alike; tests of that choice set the load they mean.
os.environ[BUSY_VARIABLE] = "0"


@pytest.fixture(autouse=True, scope="session")
def private_data_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Decoded CIFAR caches go to the test session's own folder, not the user's."""
    os.environ[CACHE_VARIABLE] = str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture
def paratrain_here(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> CLI:
    """``paratrain_here("train", ...)``: the command run in this process, in ``tmp_path``
    (its processes start from the test session's fork server, not from a new interpreter
    that imports torch again), returned like :func:`paratrain_cli`'s finished process. For
    tests of what a run computes; where the command's start-up, signals or exit are the
    subject, ``paratrain_cli``. Not for ``--deterministic``, which changes this process's
    torch for good."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        assert "--deterministic" not in args, "use paratrain_cli: it would stay on here"
        capfd.readouterr()
        code = main(list(args))
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["paratrain", *args], code, out, err)

    return run


@pytest.fixture
def paratrain_cli(tmp_path: Path) -> CLI:
    """``paratrain_cli("train", "--strategy", "ddp", ...)`` runs ``python -m paratrain ...``
    in ``tmp_path`` (``helpers.cli.run_paratrain``) and returns the finished process (stdout and
    stderr as text)."""

    def run(
        *args: str, env: dict[str, str] | None = None, timeout: float = 240
    ) -> subprocess.CompletedProcess[str]:
        return run_paratrain(*args, cwd=tmp_path, env=env, timeout=timeout)

    return run


@pytest.fixture(scope="session")
def digits_on_one_cpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The weights of ``paratrain train`` (digits, default seed) after 50 steps on one CPU
    process, which every layout must reach: run once for the session (test_equivalence,
    test_resilience). Read only."""
    out = tmp_path_factory.mktemp("digits-on-one-cpu") / "run"
    args = ["train", "--recipe", "digits", "--strategy", "cpu", "--max-steps", "50"]
    assert main([*args, "--no-progress", "--out", str(out)]) == 0  # in this process
    return load_file(str(out / "model.safetensors"))


def assert_stopped_and_resumed_run_is_bit_identical(
    paratrain_cli: CLI, paratrain_here: CLI, tmp_path: Path, strategy: str
) -> None:
    """digits on ``cpu,cpu`` under ``strategy``: a run stopped by a signal at a random step
    (SIGTERM to the launcher, or SIGUSR1 to one rank only), then the same command again,
    equals one run to 12 steps bit for bit, and its checkpoint is plain (one process reads
    it). The stopped run is a command of its own (it gets the signal); the reference and the
    resumed run are run here (their processes start from the session's fork server)."""
    common = ("train", "--recipe", "digits", "--strategy", strategy, "--devices", "cpu,cpu")
    common += ("--no-progress", "--accumulate", "2", "--save-every", "3", "--max-steps", "12")
    assert paratrain_here(*common, "--out", "ref").returncode == 0
    step, rank = random.randint(1, 11), random.randint(0, 1)
    kind = random.choice(["launcher-sigterm", "sigusr1"])
    fault = {"PARATRAIN_TEST_FAULT": f"{kind}:{rank}:{step}"}
    stopped = paratrain_cli(*common, "--out", "run", env=subprocess_env(**fault))
    name = kind.removeprefix("launcher-").upper()
    assert stopped.returncode == 128 + getattr(signal, name), (fault, stopped.stderr[-2000:])
    # --oom auto (train's default) says once where it cannot recover (pipeline), else nothing
    oom_note = "paratrain: note: --oom auto: out-of-memory recovery is not available under "
    notes = [x for x in stopped.stderr.splitlines(keepends=True) if x.startswith(oom_note)]
    assert len(notes) == (strategy == "pipeline"), stopped.stderr
    if notes:
        assert f"--strategy {strategy} (its schedule runs" in notes[0]
        stopped.stderr = stopped.stderr.replace(notes[0], "")
    line = f"paratrain: stopped by {name} after step {step}: checkpoint run/checkpoints/step-"
    assert stopped.stderr.startswith(line) and stopped.stderr.count("\n") == 1, stopped.stderr
    print(f"\n{strategy} x2, {fault}: {stopped.stderr.strip()}")
    resumed = paratrain_here(*common, "--out", "run")  # the same command again
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "continuing from run/checkpoints/step-" in resumed.stderr
    ref = load_file(str(tmp_path / "ref" / "model.safetensors"))
    run = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert ref.keys() == run.keys() and all(torch.equal(ref[k], run[k]) for k in ref)
    # the checkpoint is plain: one process (this one) reads it like any other
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        code = main(["ckpt", "inspect", str(tmp_path / "run/checkpoints/step-000012")])
    assert code == 0 and strategy in shown.getvalue()
    digits = DigitsCNN()
    paratrain.load_weights(digits, tmp_path / "run" / "checkpoints" / "step-000012")
    optimizer = torch.optim.SGD(digits.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(
        torch.load(tmp_path / "run/checkpoints/step-000012/optimizer.pt", weights_only=True)
    )
