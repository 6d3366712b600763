"""Each layout's memory per device, from traced steps of one device (:mod:`.trace`).

A traced step at the batch one device of the layout sees gives that device's parameters,
gradients, optimizer state, activations and the rest; each layout then changes what it
changes:

* ``cpu``, ``cuda``: one device, the whole batch;
* ``ddp`` xN: each process a 1/N part of the batch, plus DDP's gradient buckets (as large
  as the gradients);
* ``dp`` xN: device 0 also gathers every replica's output; the others hold a replica, its
  gradients and their part's activations, no optimizer state;
* ``dp-balanced`` xN: as ``dp``, but the outputs stay where they were computed;
* ``fsdp`` xN: parameters, gradients and optimizer state 1/N each, plus the gathered
  parameters (and gradients) of the two largest blocks at a time and what no block holds;
* ``hsdp`` RxS (``fsdp --replicate R``, from 4 devices, R = 2): as ``fsdp`` over the S = N/R
  processes of one copy, each process still a 1/N part of the batch;
* ``fsdp x tp`` Sx2 (``fsdp --tp 2``, from 4 devices, the built-in GPT only): as ``fsdp``
  over the S = N/2 groups, from a step of what one process of a pair holds (its blocks' split
  layers half as wide) on a 1/S part of the batch (both processes of a pair see the same);
* ``pipeline`` xN: each stage the parameters, all the gradients and the optimizer state of
  its layers (where the pipeline cuts the model; 1/N where the trace was not asked to cut),
  and its own layers' share of the activations (as their outputs are; 1/N where not cut) of
  the micro-batches in flight (1F1B: up to N of the 4, GPipe: all);
* ``pipeline`` RxS (``pipeline --replicate R``, from 4 devices, R = 2): each copy a pipeline
  of S = N/R stages on a 1/R part of the batch, from a step traced with the model cut into S.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from paratrain.tools.plan.trace import Breakdown, StepTrace

#: a traced step at a per-device batch size
Tracer = Callable[[int], StepTrace]


@dataclass(frozen=True)
class Layout:
    name: str
    processes: int  # devices of the layout
    #: samples one device's traced step has, for a global batch
    per_device: Callable[[int], int]
    #: the model is cut into stages, one per device (a model that cannot be cut: no row)
    staged: bool = False
    #: copies of the layout (``--replicate``): sharded over processes // replicate
    replicate: int = 1
    #: processes that split each layer (``--tp``): sharded over processes // tp, from a
    #: step of what one of them holds
    tp: int = 1


def layouts(
    devices: int, accelerator: str, pipeline_copies: bool = False, tensor_parallel: bool = False
) -> list[Layout]:
    """The layouts worth planning on ``devices`` devices of type ``accelerator``;
    ``pipeline_copies``: a pipeline in two copies as well (its own traces are given);
    ``tensor_parallel``: fsdp x tp in pairs as well (its own traces are given)."""
    single = Layout(accelerator, 1, lambda batch: batch)
    if devices < 2:
        return [single]
    part = _part(devices)
    names: tuple[str, ...] = ("dp", "dp-balanced") if accelerator == "cuda" else ()
    names += ("ddp", "fsdp", "pipeline")
    found = [single] + [Layout(name, devices, part, name == "pipeline") for name in names]
    if has_pairs(devices):  # two copies, each sharded over half the devices
        if tensor_parallel:  # pairs splitting each layer, sharded over the pairs
            found.append(Layout(tp_row(devices), devices, _part(devices // 2), tp=2))
        found.append(Layout(f"hsdp 2x{devices // 2}", devices, part, replicate=2))
        if pipeline_copies:
            copy = _part(2)
            found.append(Layout(f"pipeline 2x{devices // 2}", devices, copy, True, 2))
    return found


def tp_row(devices: int) -> str:
    """The name of fsdp x tp's row (``fsdp --tp 2``) on ``devices`` devices."""
    return f"fsdp x tp {devices // 2}x2"


def has_pairs(devices: int) -> bool:
    """Whether ``devices`` make the two-dimensional rows (two copies, or pairs)."""
    return devices >= 4 and devices % 2 == 0


def _part(devices: int) -> Callable[[int], int]:
    return lambda batch: max(1, -(-batch // devices))


def _stage_shares(whole: StepTrace, n: int) -> list[float]:
    """Each stage's share of the parameters: as the pipeline cuts the model where the
    trace knows it, else even."""
    stages = whole.stage_parameter_bytes
    if len(stages) != n or not sum(stages):
        return [1 / n] * n
    return [size / sum(stages) for size in stages]


def _activation_shares(whole: StepTrace, n: int) -> list[float]:
    """Each stage's share of the activations: as its own modules' outputs are, where the
    trace cut the model, else even."""
    stages = whole.stage_activation_bytes
    if len(stages) != n or not sum(stages):
        return [1 / n] * n
    return [size / sum(stages) for size in stages]


def per_device(layout: Layout, trace: StepTrace, whole: StepTrace) -> list[Breakdown]:
    """Each device's peak under ``layout``: ``trace`` at its per-device batch, ``whole`` at
    the global batch (pipeline's stages and dp's gathered outputs read it)."""
    n, peak = layout.processes, trace.peak
    if layout.staged:
        return _stages(layout.processes // layout.replicate, whole) * layout.replicate
    if layout.name == "ddp":
        return [peak.plus(other=trace.parameter_bytes)] * n
    if layout.name in ("dp", "dp-balanced"):
        replica = peak.scaled(optimizer=0.0)
        first = peak.plus(other=whole.output_bytes) if layout.name == "dp" else peak
        return [first] + [replica] * (n - 1)
    if layout.name == "fsdp" or layout.replicate > 1 or layout.tp > 1:
        shard = n // (layout.replicate * layout.tp)  # processes a parameter is sharded over
        whole_model = trace.parameter_bytes
        gathered = min(2 * trace.largest_block_bytes + trace.unblocked_bytes, whole_model)
        gathered = max(0, gathered - whole_model // shard)  # beyond this process's own shard
        sharded = peak.scaled(parameters=1 / shard, gradients=1 / shard, optimizer=1 / shard)
        return [sharded.plus(parameters=gathered, gradients=trace.largest_block_bytes)] * n
    return [peak]


def _stages(n: int, whole: StepTrace) -> list[Breakdown]:
    """The n stages of one pipeline, from ``whole``: a step of the batch the pipeline sees,
    traced with the model cut into n stages."""
    microbatches = 4
    in_flight = [min(n - s, microbatches) / microbatches for s in range(n)]
    # a stage's gradients are all there from its first micro-batch's backward on, while
    # the later micro-batches' activations are held (one step's peak has only some)
    return [
        whole.peak.scaled(
            parameters=share,
            gradients=0,
            optimizer=share,
            activations=flight * acts,
            other=1 / n,
        ).plus(gradients=share * whole.parameter_bytes)
        for share, acts, flight in zip(
            _stage_shares(whole, n), _activation_shares(whole, n), in_flight, strict=True
        )
    ]
