"""How processes start. A strategy says how many it needs; this module starts them.

Three ways, all PyTorch's own machinery:

* one process, or a process a launcher already started (torchrun, ``paratrain run``, or a
  child spawned below; see :func:`~paratrain.strategies.distributed.launched`): ``fn``
  runs here;
* several processes and none started yet: ``torch.multiprocessing`` starts them (forked
  from a server that imported torch once, :mod:`paratrain.launching.rank_start`) with
  ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, and ``MASTER_ADDR=127.0.0.1`` / ``MASTER_PORT``
  naming a store the launcher keeps, as torchrun's agent does (its port chosen by the OS
  as it listens: a port picked free, closed, then bound by rank 0 could be taken between
  the two, by another run whose processes then met this one's); each builds its own
  runtime with the picklable ``rebuild`` it is given (``Runtime.from_config`` bound to the
  run's configuration);
* ``paratrain run SCRIPT`` and ``paratrain train --nnodes/--max-restarts``:
  ``torch.distributed.run`` (torchrun's agent), see :mod:`paratrain.launching.agent`.

If a spawned process raises or is killed, the others are stopped (SIGTERM, then SIGKILL)
and :class:`~paratrain.utils.errors.LaunchError` names the rank and its traceback or signal. A rank
that stops making progress is found by the hang watchdog (:mod:`paratrain.launching.watchdog`). A
spawned process dies with the launcher, however the launcher ends
(:mod:`paratrain.launching.parent_death`), and the launcher's store listens on loopback only
(:mod:`paratrain.distributed.loopback`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from paratrain.distributed import loopback
from paratrain.launching import heartbeat, preemption
from paratrain.launching.launcher import (
    Launcher,
    leave_now,
    report_failure,
    report_stop,
    stopped_early,
)
from paratrain.launching.parent_death import die_with_parent, process_exists
from paratrain.launching.rank_start import Inheritance, start_method
from paratrain.launching.watchdog import POLL_SECONDS
from paratrain.strategies.distributed import launched
from paratrain.utils.atomic import FULL
from paratrain.utils.environment import REPORT_DIR_VARIABLE, exported
from paratrain.utils.errors import LaunchError, UserError

T = TypeVar("T")


class ProcessRuntime(Protocol):
    """What the launcher needs of the object each process trains with."""

    def teardown(self) -> None: ...


class MainProcess(Protocol):
    """Who is the main process, and how it tells the others (a runtime or a collective)."""

    @property
    def is_main(self) -> bool: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...


R = TypeVar("R", bound=ProcessRuntime)

#: seconds the other processes get to stop by themselves once one failed, before SIGTERM
#: (and as much again before SIGKILL)
GRACE_SECONDS = 5.0
_RESULT = "result.pkl"


def launch(
    runtime: R,
    processes: int,
    rebuild: Callable[[], R],
    fn: Callable[..., T],
    *args: Any,
    environment: dict[str, str] | None = None,
    hang_seconds: float | None = None,
) -> T | None:
    """Run ``fn(runtime, *args)`` in ``processes`` processes.

    Here, with ``runtime``, when one process is enough or a launcher already started this
    one; otherwise in spawned processes that each call ``rebuild()`` for their own runtime.

    Returns ``fn``'s result in a one-process run and in a process a launcher started; after
    spawning processes, rank 0's result (it must be picklable). ``fn`` and ``args`` must be
    picklable too: define ``fn`` at the top level of a module, and guard the script's entry
    point with ``if __name__ == "__main__":``. ``environment``: variables the spawned
    processes get before they import anything (their threads, :mod:`paratrain.launching.threads`).
    ``hang_seconds``: the hang watchdog's timeout (None: ``PARATRAIN_HANG_TIMEOUT`` or 600;
    0: off).
    """
    if processes == 1 or launched():
        return fn(runtime, *args)
    with exported(environment or {}):
        return spawn(rebuild, fn, args, processes, hang_seconds)


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it). Closed again before it is
    returned: another process may take it before the caller binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(
    rebuild: Callable[[], ProcessRuntime],
    fn: Callable[..., T],
    args: tuple[Any, ...],
    nprocs: int,
    hang_seconds: float | None = None,
) -> T:
    """Start ``nprocs`` processes running ``fn(rebuild(), *args)``."""
    try:
        pickle.dumps((rebuild, fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise UserError(
            "rt.launch starts new processes and pickles the function and its arguments: "
            f"define the function at the top level of a module ({exc})"
        ) from None
    result: T = SpawnLauncher(nprocs, hang_seconds).start(rebuild, fn, args)
    return result


class SpawnLauncher(Launcher):
    """``torch.multiprocessing`` spawns the processes of one machine (``rt.launch``)."""

    def __init__(self, nprocs: int, hang_seconds: float | None = None) -> None:
        self.nprocs = nprocs
        self.hang_seconds = hang_seconds

    def rank_environment(self, rank: int, port: int) -> dict[str, str]:
        """What rank ``rank`` finds in its environment: what torchrun would give it, and
        this launcher's folder."""
        return {
            # the launcher's pid is handed to _worker itself: its own children look for
            # their own parents
            **self.child_environment(parent=False),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.nprocs),
            "LOCAL_WORLD_SIZE": str(self.nprocs),
            "GROUP_RANK": "0",
            "MASTER_ADDR": loopback.LOOPBACK,
            "MASTER_PORT": str(port),
            # the store is the launcher's: every rank connects to it (torch's own meaning)
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }

    def start(self, *args: Any) -> Any:
        rebuild, fn, fn_args = args
        with self.folder("paratrain-launch-") as tmp, _store() as port:
            here, method = dict(os.environ), start_method()  # what a spawned process gets
            handed = [
                Inheritance({**here, **self.rank_environment(rank, port)}, method)
                for rank in range(self.nprocs)
            ]
            context = mp.start_processes(
                _worker,
                args=(rebuild, fn, fn_args, handed, os.getpid()),
                nprocs=self.nprocs,
                join=False,
                start_method=method,
            )
            # The processes have a process group of their own (see _worker): a stop signal
            # (Ctrl-C in a terminal too) reaches them once, passed on from here.
            with preemption.forwarding(lambda signum: _send(context.processes, signum)) as got:
                try:
                    while not context.join(timeout=POLL_SECONDS, grace_period=GRACE_SECONDS):
                        hang = self.watchdog.check() if self.watchdog is not None else None
                        if hang is not None:
                            raise LaunchError(hang.message())
                except ProcessException as exc:
                    if got:  # stopped before the loop could handle the signal
                        raise stopped_early(got[0]) from None
                    raise self._failure(exc, context) from None
                finally:
                    _stop(context.processes)
                    for name in context.error_files:
                        Path(name).unlink(missing_ok=True)
            stopped = self.stopped()
            if stopped is not None:
                raise stopped
            result_file = tmp / _RESULT
            if not result_file.exists():  # rank 0 was interrupted (SIGINT) and exited quietly
                if got:
                    raise stopped_early(got[0])
                raise LaunchError("rank 0 stopped before returning a result")
            with open(result_file, "rb") as handle:
                return pickle.load(handle)

    def _first_failed_rank(self, exc: ProcessException) -> int:
        """The rank that failed first: torch reports the first exit it noticed, which can
        be a consequence. A killed process is always a cause."""
        if not isinstance(exc, mp.ProcessRaisedException):
            return exc.error_index
        failures = self.reports.failures()
        return failures[0].rank if failures else exc.error_index

    def _failure(self, exc: ProcessException, context: Any) -> Exception:
        """One exception naming the failed rank and its traceback, signal or exit code."""
        rank = self._first_failed_rank(exc)
        if rank != exc.error_index and not os.path.exists(context.error_files[rank]):
            rank = exc.error_index  # stopped before it could say why: report what torch saw
        said = {f.rank: f.error() for f in self.reports.failures()}.get(rank)
        if said is not None:
            return said
        who = f"rank {rank} (pid {context.processes[rank].pid})"
        if rank != exc.error_index:
            with open(context.error_files[rank], "rb") as handle:
                trace = str(pickle.load(handle)).rstrip()
            return LaunchError(f"{who} failed; the other processes were stopped:\n{trace}")
        if isinstance(exc, mp.ProcessExitedException):
            if exc.signal_name:
                cause = f"was killed by signal {exc.signal_name}"
            else:
                cause = f"exited with code {exc.exit_code}"
            return LaunchError(f"{who} {cause}; the other processes were stopped")
        trace = exc.msg.split("terminated with the following error:\n", 1)[-1].rstrip()
        return LaunchError(f"{who} failed; the other processes were stopped:\n{trace}")


@contextlib.contextmanager
def _store() -> Iterator[int]:
    """A store for the processes' rendezvous, kept by the launcher while they run, on a
    loopback port the OS chose as it began listening; its port."""
    # the processes' own operations wait as long as they choose; this one makes none
    server = loopback.store_server(loopback.LOOPBACK, 0, timedelta(minutes=5))
    try:
        yield int(server.port)
    finally:
        del server


def _worker(
    rank: int,
    rebuild: Callable[[], ProcessRuntime],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    handed: list[Inheritance],
    launcher: int,
) -> None:
    """One started process: the launcher's environment, a fresh runtime, ``fn``."""
    # never train on alone if the launcher is killed: forked from the fork server, the
    # process dies with the server, which ends when the launcher does
    die_with_parent(launcher if os.getppid() == launcher else os.getppid())
    if not process_exists(launcher):
        os._exit(1)
    handed[rank].adopt()
    heartbeat.arm()
    with contextlib.suppress(OSError):  # signals come from the launcher, once
        os.setpgid(0, 0)
    try:
        runtime = rebuild()
        result = fn(runtime, *args)
        runtime.teardown()  # reads the last steps' checks first: a NaN is said here
    except preemption.Stopped as exc:  # a checkpoint was saved: the launcher exits with it
        report_stop(exc)
        runtime.teardown()
        return
    except (UserError, LaunchError) as exc:
        # Bad input found late is still bad input: the parent re-raises it as such; a
        # LaunchError is said in one line (a non-finite loss, ranks out of step). Left at
        # once: the interpreter's exit would tear down a process group whose peers are
        # gone, and gloo's threads abort the process (SIGABRT) after the line was said.
        leave_now(report_failure(exc))
    except OSError as exc:
        if exc.errno not in FULL:
            report_failure(exc)
            raise
        # A full disk (metrics, weights): one line, like bad input.
        text = exc.strerror if "no space" in str(exc.strerror) else f"no space left: {exc}"
        leave_now(report_failure(UserError(str(text))))
    except Exception as exc:
        # No teardown: exiting closes this process's connections, so the others'
        # collectives fail now instead of at a timeout.
        report_failure(exc)
        raise
    if rank == 0:
        with open(Path(handed[0].variables[REPORT_DIR_VARIABLE]) / _RESULT, "wb") as handle:
            pickle.dump(result, handle)


def _send(processes: Sequence[Any], signum: int) -> None:
    for process in processes:
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)


def _stop(processes: Sequence[Any]) -> None:
    """No orphans, whatever happened: SIGTERM, then SIGKILL what is still alive."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(GRACE_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()


def on_main(runtime: MainProcess, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the main process only; every process gets its result.

    A ``UserError`` it raises is raised in every process, so all of them stop alike.
    """
    outcome: tuple[bool, Any] = (True, None)
    if runtime.is_main:
        try:
            outcome = (True, fn(*args))
        except UserError as exc:
            outcome = (False, str(exc))
    ok, value = runtime.broadcast_object(outcome)
    if not ok:
        raise UserError(value)
    return value
