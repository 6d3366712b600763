"""What a bench measured: its settings, each combination's result, the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from paratrain.tools.bench.combos import Combo
from paratrain.tools.bench.noise import MachineLoad, cores
from paratrain.tools.bench.recommend import Candidate, Recommendation
from paratrain.tools.bench.stats import throughputs
from paratrain.tools.bench.task import TaskSource


@dataclass
class BenchSettings:
    source: TaskSource
    strategies: list[str] | None = None
    precisions: list[str] | None = None
    batch_sizes: list[int] | None = None
    devices: str | None = None
    steps: int = 100
    warmup: int = 5
    repeats: int = 5
    seed: int = 0
    timeout: float = 600.0
    #: two leaders within noise of each other get EXTRA_WINDOWS more windows each
    retime: bool = True
    #: also measure each combination with activation checkpointing
    activation_checkpointing: bool = False
    #: intra-op thread counts per process to measure on CPU layouts (None: combos.py's)
    threads: list[int] | None = None
    #: fresh worker processes per combination, its rounds alternating between them (None:
    #: CPU_INSTANCES on the CPU, one where a GPU's memory would hold them all at once)
    instances: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": asdict(self.source),
            "strategies": self.strategies,
            "precisions": self.precisions,
            "batch_sizes": self.batch_sizes,
            "devices": self.devices,
            "steps": self.steps,
            "warmup": self.warmup,
            "repeats": self.repeats,
            "seed": self.seed,
            "timeout": self.timeout,
            "retime": self.retime,
            "activation_checkpointing": self.activation_checkpointing,
            "threads": self.threads,
            "instances": self.instances,
        }


@dataclass
class RunResult:
    """One combination: its configuration, what happened, and every measurement."""

    combo: Combo
    status: str  # ok | oom | error | skipped
    reason: str | None = None
    spec: dict[str, Any] | None = None
    seconds: list[float] = field(default_factory=list)
    retimed_seconds: list[float] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    gathered_bytes_per_step: int | None = None
    runtime: dict[str, Any] | None = None
    traceback: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)  # start/end of each process run
    #: a clear loser (bench.noise.clear_losers): not timed after its first windows
    stopped_early: bool = False
    #: ``paratrain plan``'s peak per device for this combination (None: not planned)
    predicted_peak_bytes: list[int] | None = None

    @property
    def samples_per_step(self) -> int:
        return self.combo.batch_size

    def samples_per_second(self) -> list[float]:
        """Throughput of every timed window, first run and re-timing together."""
        steps = int(self.spec["steps"]) if self.spec else 0
        windows = self.seconds + self.retimed_seconds
        return throughputs(windows, steps * self.samples_per_step)

    def step_seconds(self) -> list[float]:
        steps = int(self.spec["steps"]) if self.spec else 1
        return [s / steps for s in self.seconds + self.retimed_seconds]

    def candidate(self) -> Candidate:
        return Candidate(self.combo.label, self.status, self.samples_per_second())


@dataclass
class BenchReport:
    settings: BenchSettings
    results: list[RunResult]
    recommendation: Recommendation
    started_at: str
    finished_at: str
    wall_seconds: float
    train_samples: int
    arguments: dict[str, Any] = field(default_factory=dict)  # the command line, parsed
    #: other work on the machine, looked at between runs
    load: MachineLoad = field(default_factory=lambda: MachineLoad(cores()))
    #: how the bench ran where it differs from what was asked (one line each)
    remarks: list[str] = field(default_factory=list)
