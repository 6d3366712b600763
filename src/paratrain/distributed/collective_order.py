"""Processes that disagree about the next collective stop in seconds, with one message.

A collective that only some processes reach (``rt.save`` under ``if rank == 0:``, an
``rt.all_reduce`` inside a rank guard, loops of unequal length) waits for the others until
the backend's timeout (30 minutes), then ends in a raw backend traceback. Here each process
numbers the runtime's collectives as it enters them (:class:`Ledger`: a counter and a name,
no communication) and a background thread publishes that position to the launcher's store
when it changes (about once a second at most). When a process has waited inside the same
collective for ``PARATRAIN_COLLECTIVE_CHECK`` seconds (default 50), its thread reads every
process's position: if some process is in another collective, or has finished, the
processes disagree. The first thread to see it stores one message; every process's thread
then hands it to its launcher (``paratrain run``'s report files, ``rt.launch``'s, or
standard error under plain torchrun) and ends its process. A process that waits there
while every other is in the same collective (the main process writing a large checkpoint)
is left alone, and so is one whose peers are busy outside the runtime's collectives: the
hang watchdog (:mod:`paratrain.launching.watchdog`) answers for those.

The cost to the training step is the ledger's two attribute updates per collective.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType

from paratrain.utils import environment
from paratrain.utils.errors import UserError
from paratrain.utils.reports import ReportFolder

CHECK_VARIABLE = "PARATRAIN_COLLECTIVE_CHECK"
#: seconds inside one collective before the positions are compared: the processes are
#: stopped within a minute, and a peer merely slow to arrive has time to
DEFAULT_CHECK_SECONDS = 50.0
#: where the processes of paratrain's launchers leave a one-line error (``rt.launch``'s,
#: ``paratrain run``'s: :mod:`paratrain.utils.reports`)
REPORT_DIR_VARIABLE = environment.REPORT_DIR_VARIABLE
POLL_SECONDS = 0.5
#: the name of the collective that ends a run: leaving the process group together
END_OF_RUN = "the end of the run (leaving the process group)"
_VERDICT = "verdict"


def check_seconds() -> float | None:
    """``PARATRAIN_COLLECTIVE_CHECK`` in seconds (default 50); None when it is 0 (off)."""
    raw = environment.current().get(CHECK_VARIABLE)
    if not raw:
        return DEFAULT_CHECK_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise UserError(f"{CHECK_VARIABLE}={raw!r} must be a number of seconds, 0 for off")
    return seconds or None


@dataclass(frozen=True)
class Position:
    """Where one process stands: its collective count, the one it is in (if any)."""

    rank: int
    count: int
    inside: str  # "" when in none
    since: float
    last: str  # the last collective it left

    def encode(self) -> str:
        return f"{self.count}|{self.since!r}|{self.inside}|{self.last}"

    @classmethod
    def decode(cls, rank: int, text: str) -> Position:
        count, since, inside, last = text.split("|", 3)
        return cls(rank, int(count), inside, float(since), last)

    def where(self) -> str:
        if self.inside == END_OF_RUN:
            return "has finished: it waits at the end of the run"
        if self.inside:
            return f"is in {self.inside} (collective #{self.count})"
        after = f" after {self.last} (#{self.count})" if self.last else ""
        return f"is outside the runtime's collectives{after}"


class Ledger:
    """This process's position: which collective of the runtime it is in, by number."""

    def __init__(self) -> None:
        self.count = 0
        self.inside = ""
        self.last = ""
        self.since = time.time()
        self._depth = 0

    def position(self, rank: int) -> Position:
        return Position(rank, self.count, self.inside, self.since, self.last)

    def operation(self, name: str) -> _Operation:
        """Around one collective of the runtime; nested ones belong to the outer one."""
        return _Operation(self, name)


class _Operation:
    """A context manager without a generator's cost: it sits in every training step."""

    __slots__ = ("ledger", "name")

    def __init__(self, ledger: Ledger, name: str) -> None:
        self.ledger = ledger
        self.name = name

    def __enter__(self) -> None:
        ledger = self.ledger
        if ledger._depth == 0:
            ledger.count += 1
            ledger.inside = self.name
            ledger.since = time.time()
        ledger._depth += 1

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        ledger = self.ledger
        ledger._depth -= 1
        if ledger._depth == 0:
            ledger.last, ledger.inside = ledger.inside, ""


#: the process's ledger: one per process, whichever runtime or collective counts
LEDGER = Ledger()


def _absent(positions: list[Position], waiting: Position) -> list[Position]:
    """The processes surely not in ``waiting``'s collective: in another, or past it."""
    return [
        p
        for p in positions
        if p.rank != waiting.rank
        and (p.count, p.inside) != (waiting.count, waiting.inside)
        and (p.inside or p.count > waiting.count)
    ]


def disagreement(positions: list[Position], waiting: Position) -> str | None:
    """The message when ``waiting`` (inside a collective) is there without every process."""
    absent = _absent(positions, waiting)
    if not absent:
        return None
    if waiting.inside == END_OF_RUN:  # name the user's collective, not the end of the run
        named = [p for p in absent if p.inside and p.inside != END_OF_RUN]
        if named:
            waiting = named[0]
            absent = _absent(positions, waiting)
    present = [p.rank for p in positions if (p.count, p.inside) == (waiting.count, waiting.inside)]
    waited = time.time() - waiting.since
    others = "; ".join(f"rank {p.rank} {p.where()}" for p in absent)
    return (
        f"the processes disagree about the next collective: {_ranks(present)} "
        f"{'has' if len(present) == 1 else 'have'} waited {waited:.0f}s in {waiting.inside} "
        f"(collective #{waiting.count}), which {_ranks([p.rank for p in absent])} did not "
        f"reach: {others}. Every process must call {waiting.inside}: a rank guard around it "
        f"(`if rank == 0:`), or loops of unequal length, let only some reach it (rt.save and "
        f"rt.save_weights write from the main process by themselves). Every process was "
        f"stopped ({CHECK_VARIABLE}={_seconds()}; 0 turns this check off)"
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def _seconds() -> str:
    seconds = check_seconds()
    return "0" if seconds is None else f"{seconds:g}"


class OrderCheck:
    """The background thread of one process: publishes its position, compares on a wait."""

    def __init__(self, store: object, rank: int, world_size: int, seconds: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.seconds = seconds
        self._stop = threading.Event()
        self._published = ""
        self._thread = threading.Thread(target=self._run, name="paratrain-order", daemon=True)

    def start(self) -> OrderCheck:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * POLL_SECONDS)

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # the store gone: the run is ending anyway
            while not self._stop.wait(POLL_SECONDS):
                self._tick()

    def _tick(self) -> None:
        store = self.store
        position = LEDGER.position(self.rank)
        encoded = position.encode()
        if encoded != self._published:
            store.set(f"rank{self.rank}", encoded)  # type: ignore[attr-defined]
            self._published = encoded
        if store.check([_VERDICT]):  # type: ignore[attr-defined]
            self._stop_process(store.get(_VERDICT).decode())  # type: ignore[attr-defined]
        if position.inside and time.time() - position.since >= self.seconds:
            keys = [f"rank{r}" for r in range(self.world_size)]
            if not store.check(keys):  # type: ignore[attr-defined]
                return  # a process has not published yet: it is still starting
            values = store.multi_get(keys)  # type: ignore[attr-defined]
            positions = [Position.decode(r, v.decode()) for r, v in enumerate(values)]
            message = disagreement(positions, position)
            if message is not None:
                stored = store.compare_set(_VERDICT, "", message).decode()  # type: ignore[attr-defined]
                self._stop_process(stored)

    def _stop_process(self, message: str) -> None:
        """Hand ``message`` to the launcher and end this process (its main thread is
        blocked inside a collective: only ending the process frees it)."""
        env = environment.current()
        if env.report_dir is not None:
            ReportFolder(env.report_dir).failed(env.attempt, self.rank, "launch", message)
        elif self.store.add("printed", 1) == 1:  # type: ignore[attr-defined]  # one process says it
            print(f"paratrain: error: {message}", file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)


_check: OrderCheck | None = None


def start(rank: int, world_size: int) -> None:
    """Start this process's check, once, if it is on and the launcher's store is reachable
    (``MASTER_ADDR``/``MASTER_PORT``: torchrun, ``paratrain run``, ``rt.launch``)."""
    global _check
    seconds = check_seconds()
    if _check is not None or seconds is None or world_size < 2:
        return
    store = _store()
    if store is not None:
        _check = OrderCheck(store, rank, world_size, seconds).start()


def stop() -> None:
    """Stop the check: the processes left the group together."""
    global _check
    if _check is not None:
        _check.stop()
        _check = None


def _store() -> object | None:
    import torch.distributed as dist

    env = environment.current()
    address, port = env.master_addr, env.master_port
    if not address or not port:
        return None
    try:
        store = dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=30))
    except (RuntimeError, ValueError):
        return None
    return dist.PrefixStore(f"paratrain/order/attempt-{env.attempt}", store)
