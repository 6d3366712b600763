"""What this process's environment says, read in one place: who started the process and
as which rank (torchrun, SLURM's ``srun``, ``rt.launch``'s spawn, paratrain's agent), where
its launcher wants reports and heartbeats, and paratrain's own settings.

Modules ask :func:`current` instead of ``os.environ``: the variables are parsed here once
(``RANK`` included), into one :class:`Environment`. The snapshot is taken on first use and
taken again only if the process's environment changed since (a launcher that sets a
rank's variables, a test's ``monkeypatch.setenv``), so it is always the environment of now.
A process's own children get theirs from :func:`child_environment` (a dict handed to the
launcher), never from writes scattered over the code.

This module imports nothing of paratrain: the command line reads it before torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: the variables that make a process one rank of a group (``init_method="env://"``)
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: where a rank leaves its failure report for its launcher (:mod:`paratrain.utils.reports`)
REPORT_DIR_VARIABLE = "PARATRAIN_REPORT_DIR"
#: where a rank keeps its heartbeat for the launcher's hang watchdog
HEARTBEAT_DIR_VARIABLE = "PARATRAIN_HEARTBEAT_DIR"
#: the pid of the process that started this one, as that process knew itself
PARENT_VARIABLE = "PARATRAIN_PARENT_PID"


def _int(raw: str | None) -> int | None:
    raw = (raw or "").strip()
    return int(raw) if raw.lstrip("-").isdigit() else None


@dataclass(frozen=True)
class Environment:
    """This process's environment, parsed."""

    #: every variable, as read (for the settings below that are looked up by name)
    variables: Mapping[str, str] = field(default_factory=dict, repr=False)

    def get(self, name: str, default: str | None = None) -> str | None:
        """A variable by name (an empty value reads as unset)."""
        return self.variables.get(name) or default

    def has(self, name: str) -> bool:
        """Whether the variable is set at all, even empty."""
        return name in self.variables

    # -- the launcher's contract: torchrun, SLURM (once paratrain set it), rt.launch --------

    @property
    def launched(self) -> bool:
        """Whether a launcher started this process as one rank of a group."""
        return all(self.variables.get(name) for name in LAUNCH_VARIABLES)

    @property
    def rank(self) -> int:
        """The global rank; 0 where no launcher said."""
        return _int(self.variables.get("RANK")) or 0

    @property
    def has_rank(self) -> bool:
        """Whether a launcher set ``RANK`` (even to an empty value)."""
        return "RANK" in self.variables

    @property
    def is_rank_zero(self) -> bool:
        """Rank 0, or not launched: the process that speaks for the run."""
        return self.rank == 0

    @property
    def local_rank(self) -> int:
        return _int(self.variables.get("LOCAL_RANK")) or 0

    @property
    def world_size(self) -> int:
        return _int(self.variables.get("WORLD_SIZE")) or 1

    @property
    def local_world_size(self) -> int | None:
        """The processes the launcher started on this machine (``LOCAL_WORLD_SIZE``, or
        ``PET_NPROC_PER_NODE`` under a Kubeflow PyTorchJob without torchrun); None when
        not launched."""
        if not self.launched:
            return None
        per_pod = _int(self.variables.get("PET_NPROC_PER_NODE"))
        if "LOCAL_WORLD_SIZE" not in self.variables and per_pod is not None:
            return per_pod
        return _int(self.variables.get("LOCAL_WORLD_SIZE")) or self.world_size

    @property
    def master_addr(self) -> str | None:
        return self.variables.get("MASTER_ADDR") or None

    @property
    def master_port(self) -> int | None:
        return _int(self.variables.get("MASTER_PORT"))

    @property
    def attempt(self) -> int:
        """How many times torchrun's agent restarted the processes (0: the first attempt)."""
        return _int(self.variables.get("TORCHELASTIC_RESTART_COUNT")) or 0

    @property
    def agent_store(self) -> bool:
        """Whether torchrun's agent keeps the store at ``MASTER_ADDR:MASTER_PORT`` (it
        outlives the processes)."""
        return self.variables.get("TORCHELASTIC_USE_AGENT_STORE") == "True"

    # -- paratrain's launchers -----------------------------------------------------------

    @property
    def report_dir(self) -> Path | None:
        """Where this rank reports a failure to paratrain's launcher; None: no such
        launcher (plain torchrun, one process)."""
        raw = self.variables.get(REPORT_DIR_VARIABLE)
        return Path(raw) if raw else None

    @property
    def heartbeat_dir(self) -> Path | None:
        """Where this rank keeps its heartbeat; None: no watchdog watches it."""
        raw = self.variables.get(HEARTBEAT_DIR_VARIABLE)
        return Path(raw) if raw else None

    @property
    def parent_pid(self) -> int | None:
        """The pid of the launcher that started this process, as it gave it."""
        return _int(self.variables.get(PARENT_VARIABLE))

    @property
    def slurm_job_id(self) -> str:
        return self.variables.get("SLURM_JOB_ID", "")

    def cache_home(self) -> Path:
        """``$XDG_CACHE_HOME``, else ``~/.cache``."""
        return Path(self.variables.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"))


_current: Environment | None = None
_source: dict[str, str] = {}


def current() -> Environment:
    """This process's environment, parsed once (and again only after it changed)."""
    global _current, _source
    if _current is None or os.environ != _source:
        _source = dict(os.environ)
        _current = Environment(dict(_source))
    return _current


def child_environment(
    variables: Mapping[str, str] | None = None, without: Iterable[str] = ()
) -> dict[str, str]:
    """What a child process starts with: this process's environment less ``without``, with
    ``variables`` set."""
    dropped = set(without)
    inherited = {k: v for k, v in os.environ.items() if k not in dropped}
    return {**inherited, **(variables or {})}


def set_default(name: str, value: str) -> None:
    """Set ``name`` for this process and its children unless it is set: for libraries that
    read their settings from the environment (Ray, MLflow, cuBLAS)."""
    os.environ.setdefault(name, value)


def export(variables: Mapping[str, str]) -> None:
    """Set ``variables`` for this process and the children it starts from now on (torchrun's
    agent hands its own environment on to the processes it starts)."""
    os.environ.update(variables)


def replace(variables: Mapping[str, str]) -> None:
    """This process's environment becomes ``variables`` (a process forked from a server
    takes its launcher's: :mod:`paratrain.launching.rank_start`)."""
    os.environ.clear()
    os.environ.update(variables)


def unset(*names: str) -> None:
    for name in names:
        os.environ.pop(name, None)


@contextlib.contextmanager
def exported(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` set while processes start (they copy the environment when they start,
    before they import anything), then put back as they were."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
