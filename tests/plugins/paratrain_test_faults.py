"""The test suite's fault injection: a paratrain plug-in driven by environment variables.

``tests/conftest.py`` puts this folder on ``sys.path`` and ``PYTHONPATH``, so that every
process a test starts (the command, spawned ranks, torchrun's workers, bench workers) finds
the entry point in ``paratrain_test_faults-0.dist-info`` and registers these handlers at
paratrain's fault injection points (``paratrain.utils.injection``). Each reads its variable
when reached, so a test may set it for this process or for the processes it starts:

* ``PARATRAIN_TEST_FAULT=KIND:RANK:STEP[:ATTEMPTS][,...]``: rank RANK fails at optimizer step
  STEP (1-based). KIND is ``kill`` (SIGKILL to itself), ``stall`` (sleeps an hour: a hang),
  ``nan`` (its loss becomes NaN), ``sigterm``, ``sigusr1``, ``sigint`` (that signal, once, to
  itself: a stop request, as a scheduler or a Ctrl-C makes one; it trains on), or
  ``launcher-sigterm``, ``launcher-sigint`` (the same, to the process that started the rank:
  paratrain's launcher or torchrun's agent). ATTEMPTS (default: every attempt) limits the
  fault to the first attempts of an elastic run (``TORCHELASTIC_RESTART_COUNT`` below it).
* ``PARATRAIN_TEST_OOM=RANK:ABOVE[:STEP]`` (RANK may be ``*``): under ``--oom auto`` rank RANK
  raises ``torch.OutOfMemoryError`` at the end of the forward of every piece of more than
  ABOVE samples (from optimizer step STEP on), as a GPU that holds ABOVE samples' activations.
* ``PARATRAIN_TEST_COMPILE_FAULT=zero-grads``: the compile check sees the compiled gradients
  of the first parameter as zeros, as torch's inductor bug leaves them.
* ``PARATRAIN_TEST_STALL_SAVE=SECONDS``: a checkpoint sleeps before it is renamed into place,
  so a test can kill the process there.
* ``PARATRAIN_TEST_BUSY_CORES=N``: the cores other work keeps busy, instead of a look at the
  machine (the suite sets 0: its runs choose alike whatever else runs beside them).

Nothing here imports torch at import time: the ``paratrain`` command loads plug-ins before
it imports torch (its OpenMP wait policy).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from paratrain.utils import injection

FAULT_VARIABLE = "PARATRAIN_TEST_FAULT"
OOM_VARIABLE = "PARATRAIN_TEST_OOM"
COMPILE_FAULT_VARIABLE = "PARATRAIN_TEST_COMPILE_FAULT"
STALL_VARIABLE = "PARATRAIN_TEST_STALL_SAVE"
BUSY_VARIABLE = "PARATRAIN_TEST_BUSY_CORES"

_SIGNALS = ("sigterm", "sigusr1", "sigint", "launcher-sigterm", "launcher-sigint")
_KINDS = ("kill", "stall", "nan", *_SIGNALS)
#: seconds a rank waits for the signal it sent its launcher to come back
FORWARD_WAIT_SECONDS = 10.0

#: the variable's value last parsed, and its faults (kind, rank, step) still to come
_plan: tuple[str, list[tuple[str, int, int]]] | None = None


def install() -> None:
    """The entry point: every handler, each inert while its variable is unset."""
    injection.register("at_step", at_step)
    injection.register("oom", oom)
    injection.register("compiled_grads", compiled_grads)
    injection.register("checkpoint_written", checkpoint_written)
    injection.register("busy_cores", busy_cores)


def reset() -> None:
    """Read ``PARATRAIN_TEST_FAULT`` afresh (a signal fault fires once per reading)."""
    global _plan
    _plan = None


def _faults() -> list[tuple[str, int, int]]:
    global _plan
    raw = os.environ.get(FAULT_VARIABLE) or ""
    if _plan is None or _plan[0] != raw:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        planned = []
        for item in raw.split(","):
            if not item:
                continue
            kind, rank, step, *attempts = item.split(":")
            if kind not in _KINDS:
                raise ValueError(f"{FAULT_VARIABLE}: unknown kind {kind!r}")
            if not attempts or restart < int(attempts[0]):
                planned.append((kind, int(rank), int(step)))
        _plan = (raw, planned)
    return _plan[1]


def at_step(rank: int, step: int, loss: Any) -> Any:
    """Apply the fault meant for ``rank`` at optimizer step ``step``, if any."""
    planned = _faults()
    for fault in list(planned):
        if fault[1:] != (rank, step):
            continue
        kind = fault[0]
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stall":
            time.sleep(3600)
        elif kind in _SIGNALS:
            planned.remove(fault)  # once: each micro-batch of a step comes here
            target = _launcher() if kind.startswith("launcher-") else os.getpid()
            os.kill(target, getattr(signal, kind.removeprefix("launcher-").upper()))
            if target != os.getpid():
                _await_forwarded()
        else:
            loss = loss * float("nan")
    return loss


def _launcher() -> int:
    """The process that started this rank: its parent, or, for a rank forked from
    multiprocessing's fork server (rt.launch on Linux), the server's parent."""
    parent = os.getppid()
    try:
        command = Path(f"/proc/{parent}/cmdline").read_bytes()
        if b"multiprocessing.forkserver" not in command:
            return parent
        return int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return parent


def _await_forwarded() -> None:
    """Wait until the launcher passed the signal on to this process, as a signal sent to
    the rank itself would be there at once: the step's agreement (before its backward)
    then carries it, and the run stops after this step, not one later."""
    from paratrain.launching import preemption

    deadline = time.monotonic() + FORWARD_WAIT_SECONDS
    while preemption.requested() is None and time.monotonic() < deadline:
        time.sleep(0.005)


def oom(rank: int, samples: int, step: int) -> None:
    """Raise as a device that holds no more than the variable's samples would."""
    raw = os.environ.get(OOM_VARIABLE)
    if not raw:
        return
    who, above, *since = raw.split(":")
    if since and step < int(since[0]):
        return
    if (who == "*" or int(who) == rank) and samples > int(above):
        import torch

        raise torch.OutOfMemoryError(
            f"{OOM_VARIABLE}: rank {rank} holds at most {above} samples, got {samples}"
        )


def compiled_grads(grads: list[Any]) -> list[Any]:
    """``zero-grads``: the compiled backward "forgot" the first parameter's gradient."""
    if os.environ.get(COMPILE_FAULT_VARIABLE) != "zero-grads" or not grads:
        return grads
    import torch

    return [torch.zeros_like(grads[0]), *grads[1:]]


def checkpoint_written(path: Path) -> None:
    seconds = os.environ.get(STALL_VARIABLE)
    if seconds:
        time.sleep(float(seconds))


def busy_cores() -> float | None:
    given = os.environ.get(BUSY_VARIABLE)
    return float(given) if given else None
