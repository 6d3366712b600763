"""Processes started by torchrun's elastic agent (``torch.distributed.run``), on one machine
or several: ``paratrain run SCRIPT`` and ``paratrain train --nnodes/--max-restarts``.

Every process runs ``python -m paratrain.cli.entry ...`` (see :mod:`paratrain.cli.entry`), which
starts the heartbeat and reports a one-line error to this launcher instead of printing it
once per rank. This launcher (one per machine):

* checks the options of several machines before starting anything;
* keeps the rendezvous, and every store and socket of the run, on 127.0.0.1 unless
  ``--rdzv-endpoint`` names an address (:mod:`paratrain.distributed.loopback`);
* watches its processes for hangs in a thread (:mod:`paratrain.launching.watchdog`);
* turns the agent's failure into one :class:`~paratrain.utils.errors.LaunchError` (or
  :class:`~paratrain.utils.errors.UserError`) naming the rank and the cause.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.distributed import loopback
from paratrain.launching.launcher import Launcher, stopped_early
from paratrain.launching.preemption import Request, Stopped
from paratrain.launching.watchdog import WatchdogThread
from paratrain.utils import environment
from paratrain.utils.errors import LaunchError, UserError
from paratrain.utils.reports import ReportFolder

LOOPBACK = loopback.LOOPBACK
#: the signals torchrun's agent passes on to its processes
SIGNALS_VARIABLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"


@dataclass(frozen=True)
class Nodes:
    """The machines of a run and how their agents meet."""

    nnodes: int = 1
    node_rank: int = 0
    #: HOST:PORT of the rendezvous; None: 127.0.0.1 and a free port (one machine only)
    endpoint: str | None = None
    #: how many times the agent restarts the processes after a failure
    max_restarts: int = 0

    def check(self) -> Nodes:
        if self.nnodes < 1:
            raise UserError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(
                f"--node-rank {self.node_rank} must be between 0 and {self.nnodes - 1} "
                f"(--nnodes {self.nnodes})"
            )
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.nnodes > 1 and self.endpoint is None:
            raise UserError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, the address of node "
                "0 that every machine can reach (the same on every machine)"
            )
        if self.endpoint is not None:
            host, _, port = self.endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UserError(f"--rdzv-endpoint {self.endpoint} must be HOST:PORT")
        return self

    @property
    def uses_agent(self) -> bool:
        """Whether ``paratrain train`` needs torchrun's agent rather than spawning."""
        return self.nnodes > 1 or self.max_restarts > 0 or self.endpoint is not None


def _on_loopback(nodes: Nodes) -> bool:
    return nodes.endpoint is None or loopback.is_loopback(nodes.endpoint.rpartition(":")[0])


def _torchrun_args(
    nodes: Nodes, nprocs: int, entry: Sequence[str], run_id: str, log_dir: Path
) -> list[str]:
    """``log_dir``: where the agent keeps its processes' error files, inside the run's own
    folder (left to itself, torch makes a ``torchelastic_*`` folder per run and never
    removes it)."""
    endpoint = nodes.endpoint or f"{LOOPBACK}:0"
    # Where the workers find the agent's store: loopback, not this machine's name.
    local = [f"--local-addr={LOOPBACK}"] if _on_loopback(nodes) else []
    return [
        *local,
        f"--nnodes={nodes.nnodes}",
        f"--node-rank={nodes.node_rank}",
        f"--nproc-per-node={nprocs}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={nodes.max_restarts}",
        "--monitor-interval=0.2",
        f"--log-dir={log_dir}",
        "-m",
        *entry,
    ]


def run_agent(
    entry: Sequence[str],
    nprocs: int,
    env: dict[str, str],
    nodes: Nodes,
    what: str,
    hang_seconds: float | None = None,
) -> None:
    """``python -m *entry`` in ``nprocs`` processes on this machine (one agent of ``nodes``).

    ``env`` is added to the environment the processes inherit; ``what`` names the work in
    errors (the script, or ``paratrain train``); ``hang_seconds``: the hang watchdog's
    timeout (None: ``PARATRAIN_HANG_TIMEOUT`` or 600; 0: off).
    """
    nodes.check()
    launcher = AgentLauncher(nodes, nprocs, what)
    launcher.hang_seconds = hang_seconds
    launcher.start(entry, env)


class AgentLauncher(Launcher):
    """torchrun's elastic agent starts this machine's processes (restarts, several machines)."""

    def __init__(self, nodes: Nodes, nprocs: int, what: str) -> None:
        self.nodes = nodes
        self.nprocs = nprocs
        self.what = what

    def start(self, *args: Any) -> None:
        entry, env = args
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser
        from torch.distributed.run import run as torch_run

        nodes = self.nodes
        # A run id that every agent of a run shares: derived from the endpoint, or fresh
        # when this agent is alone.
        run_id = f"paratrain-{nodes.endpoint}" if nodes.endpoint else str(uuid.uuid4())
        with self.folder("paratrain-agent-") as tmp, quiet_torch_logs():
            torch_args = _torchrun_args(nodes, self.nprocs, entry, run_id, tmp / "torchelastic")
            parsed = get_args_parser().parse_args(torch_args)
            # torch's agent hands its own environment on to the processes it starts.
            variables = {
                # A script's own init_process_group binds gloo/nccl to loopback too.
                **(loopback.interface_environment() if _on_loopback(nodes) else {}),
                **env,
                **self.child_environment(),
            }
            # The agent passes these on to its processes (a stop at the next step); SIGUSR1
            # is the signal `sbatch --signal=USR1@120` sends before the time limit.
            if not environment.current().has(SIGNALS_VARIABLE):
                variables[SIGNALS_VARIABLE] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
            watchdog = WatchdogThread(self.watchdog) if self.watchdog is not None else None
            stores = loopback.agent_stores() if _on_loopback(nodes) else contextlib.nullcontext()
            recorded = _first_exits_recorded(tmp)
            with (
                watchdog or contextlib.nullcontext(),
                stores,
                _second_interrupt_kills(tmp),
                recorded,
            ):
                try:
                    with environment.exported(variables):
                        torch_run(parsed)
                except ChildFailedError as exc:
                    raise self._failure(exc, watchdog) from None
                except SignalException as exc:  # the agent stopped its processes on a signal
                    _kill_left(tmp)  # a second Ctrl-C cut the agent's wait short
                    raise stopped_on_signal(tmp, exc.sigval) from None
                stopped = self.stopped()  # a process was signalled, the agent was not
                if stopped is not None:
                    raise stopped

    def _failure(self, exc: Exception, watchdog: WatchdogThread | None) -> Exception:
        """One error for the agent's failure: a hang, a rank's one-line report, or the
        cause torchrun found (rank, exit code or signal, traceback)."""
        hang = watchdog.finish() if watchdog is not None else None
        if hang is not None:
            return LaunchError(hang.message())
        said = self.reports.first_one_line()
        if said is not None:
            error = said.error()
            assert error is not None
            return error
        exc = root_first(exc, self.reports)
        format_msg = getattr(exc, "format_msg", None)
        text = format_msg() if callable(format_msg) else str(exc)
        restarts = self.nodes.max_restarts
        after = f" after {restarts} restart(s)" if restarts else ""
        first = getattr(exc, "get_first_failure", None)
        rank = int(first()[0]) if callable(first) else None
        trace = self.reports.trace(rank) if rank is not None else None
        if trace:  # the processes' own tracebacks go to reports (see paratrain.cli.entry)
            text += f"\nrank {rank}'s traceback:\n{trace}"
        return LaunchError(f"{self.what} failed{after}; the cause:\n{text.strip()}")


def root_first(exc: Exception, reports: ReportFolder) -> Exception:
    """``exc`` (torchrun's ``ChildFailedError``) with the rank that failed first as its root
    cause. torchrun takes the failure it saw first, timed to the second, ties to the lowest
    rank: a process that failed because a peer died is often seen in the same look as that
    peer. The ranks' own reports are timed finer: the earliest is the cause, unless a rank
    failed without one (killed by a signal), which then is; a rank the agent itself ended
    is not (see :func:`torn_down`)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not isinstance(exc, ChildFailedError) or not exc.failures:
        return exc
    failures = exc.failures
    reported = {f.rank: f.at for f in reports.failures()}
    torn = torn_down({rank: f.exitcode for rank, f in failures.items()})
    causes = [rank for rank in failures if rank not in torn]
    silent = [rank for rank in causes if rank not in reported]
    if silent:
        root = min(silent, key=lambda rank: (failures[rank].timestamp, rank))
    else:
        root = min(causes, key=lambda rank: (reported[rank], rank))
    first = failures[root]
    first.timestamp = min(f.timestamp for f in failures.values())
    ordered = {root: first, **{r: f for r, f in failures.items() if r != root}}
    return ChildFailedError(exc.name, ordered)


def torn_down(exit_codes: dict[int, int]) -> set[int]:
    """The ranks torchrun's agent ended itself. Once a rank fails, the agent sends the
    others SIGTERM and records them as failed in the same look: a rank that died of SIGTERM
    while another failed otherwise is not a cause. Where every rank died of SIGTERM, none
    is told apart."""
    torn = {rank for rank, code in exit_codes.items() if code == -signal.SIGTERM}
    return torn if len(torn) < len(exit_codes) else set()


def stopped_on_signal(tmp: Path, signum: int) -> BaseException:
    """What a signal to the agent ends with: the processes' stop, or an interruption."""
    saved = ReportFolder(tmp).stop()
    if saved is not None:
        return Stopped(Request(int(saved["signum"]), float(saved["at"])), str(saved["message"]))
    return stopped_early(Request(int(signum), time.time()))


@contextlib.contextmanager
def _second_interrupt_kills(tmp: Path) -> Iterator[None]:
    """The agent's first Ctrl-C passes SIGINT on and waits up to 30 s for its processes
    (they save a checkpoint); a second one SIGKILLs them and stops at once. torch registers
    its handler by this module-level name when it starts the processes."""
    from torch.distributed.elastic.multiprocessing import api

    original = api._terminate_process_handler
    interrupts = [0]

    def handle(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            interrupts[0] += 1
            if interrupts[0] > 1:
                _kill_left(tmp)
                raise KeyboardInterrupt
        original(signum, frame)

    api._terminate_process_handler = handle
    try:
        yield
    finally:
        api._terminate_process_handler = original


@contextlib.contextmanager
def _first_exits_recorded(tmp: Path) -> Iterator[None]:
    """The agent's first look that finds failed processes, recorded per attempt: the ranks
    that failed then are the cause, but for the ones it tore down in that same look, some
    without a report of their own (see :func:`torn_down` and :func:`previous_failure`)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._monitor_workers

    def monitor(agent: Any, worker_group: Any) -> Any:
        result = original(agent, worker_group)
        remaining = getattr(agent, "_remaining_restarts", None)
        if result.is_failed() and result.failures and remaining is not None:
            attempt = worker_group.spec.max_restarts - remaining
            codes = {int(rank): int(f.exitcode) for rank, f in result.failures.items()}
            ReportFolder(tmp).exited(attempt, codes)
        return result

    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]


def _kill_left(tmp: Path) -> None:
    """SIGKILL the processes of this machine still running (each leads its own session)."""
    for pid in ReportFolder(tmp).started_pids().values():
        with contextlib.suppress(OSError, ValueError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"paratrain.cli.entry" in cmdline:  # not a reused pid
                os.killpg(pid, signal.SIGKILL)


def previous_failure(tmp: Path, attempt: int, world_size: int) -> str:
    """Which rank made attempt ``attempt`` fail, as the processes of this machine left
    it in the report folder: of the ranks the agent saw fail first (all, when it did not
    record them), one that died without a word (killed), else the first that raised."""
    reports = ReportFolder(tmp)
    exits = reports.first_exits(attempt)
    first = (set(exits) - torn_down(exits)) or set(reports.started_pids(attempt))
    raised = [f for f in reports.failures(attempt) if f.kind == "crash"]
    first_raised = [f for f in raised if f.rank in first]
    raised = first_raised or raised
    silent = sorted(first & (set(reports.started_pids(attempt)) - {f.rank for f in raised}))
    if silent:
        return f"rank {silent[0]} died (killed, or exited without an error)"
    if raised:
        lines = raised[0].message.rstrip().splitlines()
        return f"rank {raised[0].rank} failed ({lines[-1] if lines else 'an error'})"
    return f"a process of another machine failed ({world_size} processes in all)"


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """torchrun's agent logs each worker's exit and every signal it passes on; paratrain
    says what matters in one line (a failure names its cause, a restart is one note)."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.Logger.manager.loggerDict)
        if name.startswith("torch.distributed")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
