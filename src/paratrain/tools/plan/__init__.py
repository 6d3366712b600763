"""`paratrain plan`: each device's peak memory per layout, predicted without allocating it
(:mod:`.trace`, :mod:`.layouts`), which layouts fit, and the largest batch of each."""

from paratrain.tools.plan.planner import LayoutPlan, MemoryPlan, plan_memory
from paratrain.tools.plan.trace import KINDS, Breakdown, StepTrace, trace_step

__all__ = [
    "KINDS",
    "Breakdown",
    "LayoutPlan",
    "MemoryPlan",
    "StepTrace",
    "plan_memory",
    "trace_step",
]
