"""Traces at two per-device batch sizes, every layout's devices, and the largest batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paratrain.tools.plan.layouts import Layout, layouts, per_device
from paratrain.tools.plan.trace import Breakdown, StepTrace

#: the largest global batch searched for
MAX_BATCH = 1 << 20


@dataclass(frozen=True)
class LayoutPlan:
    layout: str
    devices: list[Breakdown]
    fits: bool
    #: the largest global batch whose peak fits (0: not even one sample), by the traces'
    #: straight line in the batch size
    largest_batch: int

    @property
    def peak(self) -> int:
        return max(d.total for d in self.devices)

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "devices": [{**d.as_dict(), "total": d.total} for d in self.devices],
            "peak": self.peak,
            "fits": self.fits,
            "largest_batch": self.largest_batch,
        }


@dataclass
class MemoryPlan:
    model: str
    batch: int
    precision: str
    device_memory: int
    #: where the device memory figure comes from ("--device-memory", "cuda:0", "host")
    memory_source: str
    #: one process per device sharing the host's memory (CPU layouts): the sum must fit
    shared: bool
    layouts: list[LayoutPlan] = field(default_factory=list)
    #: layouts that refuse the model, and why
    refused: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "batch": self.batch,
            "precision": self.precision,
            "device_memory": self.device_memory,
            "memory_source": self.memory_source,
            "shared_memory": self.shared,
            "layouts": [p.as_dict() for p in self.layouts],
            "refused": dict(self.refused),
        }


class Traces:
    """Traced steps by per-device batch, and a straight line through two of them for the
    batch sizes not traced (activations and the rest grow with the batch)."""

    def __init__(self, trace: Any) -> None:
        self._trace = trace
        self._seen: dict[int, StepTrace] = {}

    def at(self, batch: int) -> StepTrace:
        if batch not in self._seen:
            self._seen[batch] = self._trace(batch)
        return self._seen[batch]

    def estimate(self, batch: int) -> StepTrace:
        if batch in self._seen:
            return self._seen[batch]
        sizes = sorted(self._seen)
        low, high = self._seen[sizes[0]], self._seen[sizes[-1]]
        if high.batch == low.batch:
            return high
        slope = (batch - low.batch) / (high.batch - low.batch)

        def line(a: int, b: int) -> int:
            return max(0, round(a + (b - a) * slope))

        peak = Breakdown(
            high.peak.parameters,
            high.peak.gradients,
            high.peak.optimizer,
            line(low.peak.activations, high.peak.activations),
            line(low.peak.other, high.peak.other),
        )
        outputs = line(low.output_bytes, high.output_bytes)
        return StepTrace(
            batch,
            peak,
            outputs,
            high.parameter_bytes,
            high.largest_block_bytes,
            high.unblocked_bytes,
            high.stage_parameter_bytes,
            high.stage_activation_bytes,
            high.stage_refusal,
        )


def plan_memory(
    trace: Any,
    model: str,
    batch: int,
    precision: str,
    devices: int,
    accelerator: str,
    device_memory: int,
    memory_source: str,
    copy_trace: Any = None,
    tp_trace: Any = None,
) -> MemoryPlan:
    """Plan every layout of ``devices`` devices; ``trace(b)`` traces a step of ``b`` samples
    (the model cut into ``devices`` stages); ``copy_trace(b)``, where given, the same with the
    model cut into the stages of one of two pipeline copies (``devices // 2``); ``tp_trace(b)``,
    where given, a step of what one process of a tensor parallel pair holds."""
    traces = Traces(trace)
    copies = Traces(copy_trace) if copy_trace is not None else None
    pairs = Traces(tp_trace) if tp_trace is not None else None
    shared = accelerator == "cpu"
    plan = MemoryPlan(model, batch, precision, device_memory, memory_source, shared)
    chosen = layouts(devices, accelerator, copies is not None, pairs is not None)
    for layout in chosen:  # the traces the requested batch needs, before any estimate
        if layout.tp > 1:  # from its own traces (below)
            continue
        traces.at(layout.per_device(batch))
    traces.at(batch)
    if len({t for t in (layout.per_device(batch) for layout in chosen)}) < 2:
        traces.at(2 * batch)  # two points for the straight line
    if copies is not None:
        part = max(1, -(-batch // 2))
        copies.at(part)
        copies.at(2 * part)  # two points for the straight line
    for layout in chosen:
        if pairs is not None and layout.tp > 1:
            pairs.at(layout.per_device(batch))
            pairs.at(2 * layout.per_device(batch))  # two points for the straight line
    for layout in chosen:
        source = _source(layout, traces, copies, pairs)
        whole = source.at(_seen_by_one_pipeline(layout, batch))
        if layout.staged and whole.stage_refusal:
            plan.refused[layout.name] = whole.stage_refusal
            continue
        found = per_device(layout, source.at(layout.per_device(batch)), whole)
        fits = _fits(found, device_memory, shared)
        plan.layouts.append(
            LayoutPlan(layout.name, found, fits, _largest(layout, source, device_memory, shared))
        )
    return plan


def _source(layout: Layout, traces: Traces, copies: Traces | None, pairs: Traces | None) -> Traces:
    """The traces ``layout`` is planned from."""
    if copies is not None and _in_copies(layout):
        return copies
    if pairs is not None and layout.tp > 1:
        return pairs
    return traces


def _in_copies(layout: Layout) -> bool:
    return layout.staged and layout.replicate > 1


def _seen_by_one_pipeline(layout: Layout, batch: int) -> int:
    """The batch one copy's pipeline sees: the whole batch, or its part (copies; and
    tensor parallel's, which does not read it)."""
    return layout.per_device(batch) if _in_copies(layout) or layout.tp > 1 else batch


def _fits(devices: list[Breakdown], memory: int, shared: bool) -> bool:
    if shared:
        return sum(d.total for d in devices) <= memory
    return max(d.total for d in devices) <= memory


def _largest(layout: Layout, traces: Traces, memory: int, shared: bool) -> int:
    def fits(batch: int) -> bool:
        whole = traces.estimate(_seen_by_one_pipeline(layout, batch))
        found = per_device(layout, traces.estimate(layout.per_device(batch)), whole)
        return _fits(found, memory, shared)

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_BATCH and fits(high):
        low, high = high, high * 2
    if high > MAX_BATCH:
        return MAX_BATCH
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
