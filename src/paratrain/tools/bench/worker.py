"""One measured run, in a fresh process started by the runner.

The worker builds a :class:`~paratrain.Runtime` for one combination and calls
``rt.launch``: one process for single-process layouts, a process group for the ones that
need several. Every process trains real steps (forward, loss, ``rt.backward``, optimizer
step), warms up, then times one window of ``steps`` steps, its devices synchronized around
it, each time the runner asks (:mod:`paratrain.tools.bench.control`), and when told to stop
writes ``rank<r>.json`` into the result directory.
Running out of memory is a result (``status: "oom"``), not a crash.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from paratrain.launching.parent_death import die_with_parent
from paratrain.runtime.facade import Runtime
from paratrain.strategies.base import iter_tensors
from paratrain.tools.bench import control
from paratrain.tools.bench.memory import memory_snapshot, synchronize, training_state_bytes
from paratrain.tools.bench.task import TaskSource, load_task
from paratrain.utils.atomic import atomic_write_text
from paratrain.utils.errors import LaunchError, UserError
from paratrain.utils.peak_memory import peak_rss_bytes

#: how the runner starts a worker: ``python -c WORKER_CODE SPEC.json RESULT_DIR``; once its
#: results are written it ends at once (an interpreter holding torch takes about half a
#: second of CPU to tear down, a dozen workers side by side several seconds)
WORKER_CODE = (
    "import os, sys; from paratrain.tools.bench.worker import main; code = main(sys.argv[1:]); "
    "sys.stdout.flush(); sys.stderr.flush(); os._exit(code)"
)
LAUNCH_RECORD = "launch.json"


@dataclass(frozen=True)
class RunSpec:
    """The exact configuration of one run; recorded as is in bench.json."""

    source: TaskSource
    strategy: str
    devices: str | None
    precision: str
    batch_size: int
    steps: int
    warmup: int
    repeats: int
    seed: int = 0
    activation_checkpointing: bool = False
    #: intra-op threads of each process (chosen by the bench, which sees the machine before
    #: its workers load it); None: the worker's runtime chooses
    threads: int | None = None
    #: copies of the layout (``--replicate``) and processes splitting each layer (``--tp``)
    replicate: int = 1
    tp: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        fields = dict(data)
        fields["source"] = TaskSource(**fields["source"])
        return cls(**fields)


def is_oom(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU and MPS allocators' failures."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def _one_line(exc: BaseException) -> str:
    """The exception in one line: the last of its message (where Python and torch put the
    cause), except a failed group's, whose first line names the rank and what happened (the
    rest is that rank's traceback or stack)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = (lines[0] if isinstance(exc, LaunchError) else lines[-1]) if lines else ""
    return f"{type(exc).__name__}: {text.strip()}"[:300]


def _endless(loader: Any) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise UserError("the loader gave no full batch; choose a smaller batch size")


def _output_bytes_on(output: Any, device: torch.device) -> int:
    return sum(t.nbytes for t in iter_tensors(output) if t.device == device)


def _train_and_time(rt: Runtime, spec: RunSpec, out_dir: Path) -> dict[str, Any]:
    task = load_task(spec.source, spec.batch_size)
    optimizer = task.make_optimizer(task.model.parameters())
    model, optimizer, loss_fn = rt.setup(task.model, optimizer, task.loss_fn)
    loader = rt.setup_loader(
        DataLoader(task.dataset, batch_size=spec.batch_size, shuffle=True, drop_last=True)
    )
    batches = _endless(loader)
    requests = control.Requests(out_dir, rt.rank)
    model.train()
    output_bytes: list[int] = []
    state_bytes: list[int] = []

    def step() -> None:
        inputs, targets = next(batches)
        if rt.strategy.trains_in_pipeline:  # forward and backward run together
            rt.forward_backward(model, loss_fn, inputs, targets)
        else:
            outputs = model(inputs)
            if not output_bytes:  # tensor sizes only: no synchronization
                output_bytes.append(_output_bytes_on(outputs, rt.device))
            rt.backward(loss_fn(outputs, targets))
        optimizer.step()
        if not state_bytes:  # gradients and optimizer state exist only until zero_grad
            state_bytes.append(training_state_bytes(model, optimizer))
        optimizer.zero_grad()

    # A process that drives several devices synchronizes them all; a process of a group
    # only its own (touching the others would create contexts there).
    local = list(rt.strategy.devices) if rt.world_size == 1 else [rt.device]
    for _ in range(spec.warmup):
        step()
    synchronize(local)
    requests.say_ready()
    seconds: list[float] = []
    # one window each time the runner asks, until it says stop (bench/control.py)
    while requests.next(len(seconds)):
        rt.barrier()
        synchronize(local)
        start = time.perf_counter()
        for _ in range(spec.steps):
            step()
        synchronize(local)
        seconds.append(time.perf_counter() - start)
        requests.report(len(seconds) - 1, seconds[-1])
    return {
        "seconds": seconds,
        "gathered_bytes_per_step": _gathered_bytes(rt, output_bytes),
        "runtime": rt.describe(),
        "state_bytes": state_bytes[0] if state_bytes else None,
        "local_devices": [str(d) for d in local],
    }


def _gathered_bytes(rt: Runtime, output_bytes: list[int]) -> int | None:
    """Bytes that land on the first device each step when one process drives several.

    A strategy that knows (the balanced DataParallel) says so itself; otherwise it is what
    the forward pass returned on the first device (DataParallel gathers every output there).
    Nothing is gathered by one device or by a process group, whose all-reduce is symmetric.
    """
    method = getattr(rt.strategy, "gathered_bytes_per_step", None)
    value = method() if callable(method) else method
    if isinstance(value, (int, float)):
        return int(value)
    if rt.world_size == 1 and len(rt.strategy.devices) > 1 and output_bytes:
        return output_bytes[0]
    return None


def measure_in_process(rt: Runtime, spec: RunSpec, out_dir: str) -> None:
    """The function every process of the run executes; writes ``rank<r>.json``."""
    record: dict[str, Any] = {"rank": rt.rank, "world_size": rt.world_size}
    record["baseline_rss_bytes"] = peak_rss_bytes()
    try:
        record.update(_train_and_time(rt, spec, Path(out_dir)))
        record["status"] = "ok"
    except Exception as exc:  # a failed run is a result; the others still get measured
        record["status"] = "oom" if is_oom(exc) else "error"
        record["reason"] = _one_line(exc)
        if record["status"] == "error":
            record["traceback"] = traceback.format_exc()[-3000:]
        del exc
    local = list(rt.strategy.devices) if rt.world_size == 1 else [rt.device]
    record["memory"] = memory_snapshot(local, rt.rank)
    atomic_write_text(Path(out_dir) / f"rank{rt.rank}.json", json.dumps(record) + "\n")


def main(argv: list[str]) -> int:
    """``SPEC.json RESULT_DIR``: run one combination; failures are written, not raised."""
    spec = RunSpec.from_dict(json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    out_dir = Path(argv[1])
    die_with_parent()  # it waits for the runner's requests: never alone once it is gone
    try:
        rt = Runtime(
            spec.strategy,
            spec.devices,
            spec.precision,
            seed=spec.seed,
            activation_checkpointing=spec.activation_checkpointing,
            threads=spec.threads,
            replicate=spec.replicate,
            tp=spec.tp,
        )
        rt.launch(measure_in_process, spec, str(out_dir))
    except Exception as exc:
        status = "oom" if is_oom(exc) else "error"
        record = {"status": status, "reason": _one_line(exc), "traceback": str(exc)[-3000:]}
        atomic_write_text(out_dir / LAUNCH_RECORD, json.dumps(record) + "\n")
        print(traceback.format_exc(), file=sys.stderr)
        return 1
    return 0


def collect(out_dir: Path, processes: int) -> dict[str, Any]:
    """Merge the processes' records into one result.

    A group is as slow as its slowest process: each repeat's time is the maximum over the
    processes. Memory is listed per device and per process.
    """
    records = []
    for rank in range(processes):
        path = out_dir / f"rank{rank}.json"
        if path.is_file():
            records.append(json.loads(path.read_text(encoding="utf-8")))
    launch_path = out_dir / LAUNCH_RECORD
    launch = json.loads(launch_path.read_text(encoding="utf-8")) if launch_path.is_file() else None
    outcomes = [*records, launch] if launch else records
    statuses = [r["status"] for r in outcomes]
    if "oom" in statuses:
        status = "oom"
    elif "error" in statuses or len(records) < processes:
        status = "error"
    else:
        status = "ok"
    # The cause, not its echo: a process that ran out of memory explains the others' errors.
    reasons = [r["reason"] for r in outcomes if r["status"] == status and r.get("reason")]
    if status == "error" and not reasons and len(records) < processes:
        reasons.append(f"{processes - len(records)} of {processes} process(es) wrote no result")
    result: dict[str, Any] = {"status": status, "reason": reasons[0] if reasons else None}
    result["memory"] = {
        "devices": [d for r in records for d in r.get("memory", {}).get("devices", [])],
        "host": [r["memory"]["host"] for r in records if "memory" in r],
        # parameters + gradients + optimizer state held by each process (fsdp: its shards)
        "state_bytes": [r.get("state_bytes") for r in records],
    }
    tracebacks = [r["traceback"] for r in outcomes if r.get("traceback")]
    if tracebacks:
        result["traceback"] = tracebacks[0]
    if status == "ok":
        per_rank = [r["seconds"] for r in records]
        result["seconds"] = [max(times) for times in zip(*per_rank, strict=True)]
        result["gathered_bytes_per_step"] = records[0].get("gathered_bytes_per_step")
        result["runtime"] = records[0].get("runtime")
    return result
