"""Processes started by torchrun's elastic agent (``torch.distributed.run``), on one machine
or several: ``paratrain run SCRIPT`` and ``paratrain train --nnodes/--max-restarts``.

Every process runs ``python -m paratrain.entry ...`` (see :mod:`paratrain.entry`), which
starts the heartbeat and reports a one-line error to this launcher instead of printing it
once per rank. This launcher (one per machine):

* checks the options of several machines before starting anything;
* keeps the rendezvous, and every store and socket of the run, on 127.0.0.1 unless
  ``--rdzv-endpoint`` names an address (:mod:`paratrain.loopback`);
* watches its processes for hangs in a thread (:mod:`paratrain.watchdog`);
* turns the agent's failure into one :class:`~paratrain.errors.LaunchError` (or
  :class:`~paratrain.errors.UserError`) naming the rank and the cause.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from paratrain import loopback
from paratrain.errors import LaunchError, UserError
from paratrain.heartbeat import DIRECTORY_VARIABLE
from paratrain.watchdog import Watchdog, WatchdogThread, hang_timeout

#: where the processes leave a one-line error for this launcher (see :mod:`paratrain.entry`)
REPORT_VARIABLE = "PARATRAIN_REPORT_DIR"
LOOPBACK = loopback.LOOPBACK


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


def _torchrun_args(nodes: Nodes, nprocs: int, entry: Sequence[str], run_id: str) -> list[str]:
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
        "-m",
        *entry,
    ]


def run_agent(
    entry: Sequence[str], nprocs: int, env: dict[str, str], nodes: Nodes, what: str
) -> None:
    """``python -m *entry`` in ``nprocs`` processes on this machine (one agent of ``nodes``).

    ``env`` is added to the environment the processes inherit; ``what`` names the work in
    errors (the script, or ``paratrain train``).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torch_run

    nodes.check()
    timeout = hang_timeout()
    # A run id that every agent of a run shares: derived from the endpoint, or fresh when
    # this agent is alone.
    run_id = f"paratrain-{nodes.endpoint}" if nodes.endpoint else str(uuid.uuid4())
    args = get_args_parser().parse_args(_torchrun_args(nodes, nprocs, entry, run_id))
    with tempfile.TemporaryDirectory(prefix="paratrain-agent-") as tmp:
        # A script's own init_process_group binds gloo/nccl to loopback too.
        os.environ.update(loopback.interface_environment() if _on_loopback(nodes) else {})
        os.environ.update(env)
        os.environ[REPORT_VARIABLE] = tmp
        watchdog = None
        if timeout is not None:
            os.environ[DIRECTORY_VARIABLE] = tmp
            watchdog = WatchdogThread(Watchdog(Path(tmp), timeout))
        stores = loopback.agent_stores() if _on_loopback(nodes) else contextlib.nullcontext()
        with watchdog or contextlib.nullcontext(), stores:
            try:
                torch_run(args)
            except ChildFailedError as exc:
                raise _failure(exc, Path(tmp), watchdog, what, nodes.max_restarts) from None
            finally:
                for name in (REPORT_VARIABLE, DIRECTORY_VARIABLE):
                    os.environ.pop(name, None)


def _failure(
    exc: Exception, tmp: Path, watchdog: WatchdogThread | None, what: str, restarts: int
) -> Exception:
    """One error for the agent's failure: a hang, a rank's one-line report, or the cause
    torchrun found (rank, exit code or signal, traceback)."""
    if watchdog is not None and watchdog.hang is not None:
        return LaunchError(watchdog.hang.message())
    # The last attempt's reports (an elastic run restarts), the first of them.
    reports = sorted(tmp.glob("report-*.txt"), key=lambda p: (-_attempt(p), p.stat().st_mtime))
    if reports:
        kind, _, message = reports[0].read_text(encoding="utf-8").partition("\n")
        return UserError(message) if kind == "user" else LaunchError(message)
    format_msg = getattr(exc, "format_msg", None)
    text = format_msg() if callable(format_msg) else str(exc)
    after = f" after {restarts} restart(s)" if restarts else ""
    return LaunchError(f"{what} failed{after}; the cause:\n{text.strip()}")


def _attempt(report: Path) -> int:
    """The attempt of ``report-a{ATTEMPT}-rank{RANK}.txt``."""
    return int(report.name.split("-")[1].removeprefix("a"))
