"""How a rank tells its launcher why it ended, in one place for every launcher (``rt.launch``'s
spawn and torchrun's agent under ``paratrain run`` / ``paratrain train``).

The launcher makes a folder and hands it to its processes (``PARATRAIN_REPORT_DIR``); each
rank leaves there, per attempt (torchrun's agent restarts the processes):

* ``started-a{A}-rank{R}``: its pid, once it runs (the launcher can kill what is left);
* ``report-a{A}-rank{R}.json``: why it failed, one :class:`Failure`: a user error (one
  line, exit 2), a launch error (one line, exit 1: a NaN loss, ranks out of step) or a
  crash (its traceback), with the time it happened: when one rank fails, the others fail
  soon after in their collectives, and the earliest is the cause;
* ``stopped-a{A}.json``: the stop on a signal rank 0 acted on (its line already printed);
* ``exited-a{A}.json``: written by torchrun's agent, the ranks it saw fail first and their
  exit codes (the processes it then tears down fail later, often without a report).

Every file appears whole (written aside, then renamed into place): a launcher that reads
the folder while a rank writes never sees half a report.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from paratrain.utils.errors import LaunchError, UserError

Kind = Literal["user", "launch", "crash"]
_ATTEMPT = re.compile(r"-a(\d+)")


@dataclass(frozen=True)
class Failure:
    """Why one rank failed in one attempt."""

    rank: int
    attempt: int
    kind: Kind
    #: the one line (user, launch), or the traceback (crash)
    message: str
    #: ``time.time()`` when it happened
    at: float

    def error(self) -> UserError | LaunchError | None:
        """The one-line error to raise for it; None for a crash (its traceback is told)."""
        if self.kind == "user":
            return UserError(self.message)
        if self.kind == "launch":
            return LaunchError(self.message)
        return None


def kind_of(exc: BaseException) -> Kind:
    """How a rank ending with ``exc`` reports it."""
    if isinstance(exc, UserError):
        return "user"
    if isinstance(exc, LaunchError):
        return "launch"
    return "crash"


def exit_code(kind: Kind) -> int:
    """The exit code of a rank that failed this way (and of the command)."""
    return 2 if kind == "user" else 1


class ReportFolder:
    """The folder a launcher reads and its ranks write."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    # -- a rank writes -----------------------------------------------------------------

    def started(self, attempt: int, rank: int, pid: int) -> None:
        self._write(f"started-a{attempt}-rank{rank}", str(pid))

    def failed(self, attempt: int, rank: int, kind: Kind, message: str) -> Failure:
        failure = Failure(rank, attempt, kind, message, time.time())
        record = {"kind": kind, "message": message, "at": failure.at}
        self._write(f"report-a{attempt}-rank{rank}.json", json.dumps(record))
        return failure

    def stopped(self, attempt: int, stop: Mapping[str, Any]) -> None:
        self._write(f"stopped-a{attempt}.json", json.dumps(dict(stop)))

    def exited(self, attempt: int, codes: Mapping[int, int]) -> None:
        if not (self.directory / f"exited-a{attempt}.json").exists():  # the first look only
            self._write(
                f"exited-a{attempt}.json", json.dumps({str(r): c for r, c in codes.items()})
            )

    def _write(self, name: str, text: str) -> None:
        aside = self.directory / f".{name}.{os.getpid()}.tmp"
        aside.write_text(text, encoding="utf-8")
        os.replace(aside, self.directory / name)  # appears whole, or not at all

    # -- the launcher reads ------------------------------------------------------------

    def failures(self, attempt: int | None = None) -> list[Failure]:
        """The failures of ``attempt`` (None: the newest attempt with any), earliest first."""
        found = []
        for path in self.directory.glob("report-a*-rank*.json"):
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
                rank, at = _rank_of(path), float(record["at"])
                kind, message = record["kind"], str(record["message"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            found.append(Failure(rank, _attempt_of(path), kind, message, at))
        if attempt is None and found:
            attempt = max(f.attempt for f in found)
        return sorted((f for f in found if f.attempt == attempt), key=lambda f: (f.at, f.rank))

    def first_one_line(self) -> Failure | None:
        """The earliest user or launch error of the newest attempt that has one: the one
        error to tell."""
        attempts = sorted({_attempt_of(p) for p in self.directory.glob("report-a*.json")})
        for attempt in reversed(attempts):
            lines = [f for f in self.failures(attempt) if f.kind != "crash"]
            if lines:
                return lines[0]
        return None

    def trace(self, rank: int) -> str | None:
        """The traceback ``rank`` left in its newest attempt, if it crashed."""
        mine = [f for f in self._all_of(rank) if f.kind == "crash"]
        return max(mine, key=lambda f: f.attempt).message.rstrip() if mine else None

    def _all_of(self, rank: int) -> list[Failure]:
        attempts = {_attempt_of(p) for p in self.directory.glob(f"report-a*-rank{rank}.json")}
        return [f for a in attempts for f in self.failures(a) if f.rank == rank]

    def started_pids(self, attempt: int | None = None) -> dict[int, int]:
        """``{rank: pid}`` of the processes that started (in ``attempt``, or in any)."""
        pattern = "started-a*-rank*" if attempt is None else f"started-a{attempt}-rank*"
        pids = {}
        for path in self.directory.glob(pattern):
            with contextlib.suppress(OSError, ValueError):
                pids[_rank_of(path)] = int(path.read_text(encoding="utf-8"))
        return pids

    def first_exits(self, attempt: int) -> dict[int, int]:
        """``{rank: exit code}`` of the ranks the agent saw fail first in ``attempt`` (empty:
        not recorded, as on a machine whose own processes did not fail first)."""
        try:
            saved = json.loads((self.directory / f"exited-a{attempt}.json").read_text("utf-8"))
            return {int(rank): int(code) for rank, code in saved.items()}
        except (OSError, ValueError, AttributeError, TypeError):
            return {}

    def stop(self) -> dict[str, Any] | None:
        """The stop the newest attempt recorded, or None."""
        paths = sorted(self.directory.glob("stopped-a*.json"), key=_attempt_of)
        if not paths:
            return None
        saved: dict[str, Any] = json.loads(paths[-1].read_text(encoding="utf-8"))
        return saved


def _attempt_of(path: Path) -> int:
    found = _ATTEMPT.search(path.name)
    return int(found.group(1)) if found else 0


def _rank_of(path: Path) -> int:
    return int(path.name.split("-rank")[1].split(".")[0])
