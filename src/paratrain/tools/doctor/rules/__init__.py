"""The registry of doctor's rules, one module per family."""

from __future__ import annotations

from paratrain.tools.doctor.rules import (
    checkpoints,
    gradients,
    launching,
    loading,
    multinode,
    numerics,
    output,
    placement,
    processes,
    samplers,
    syncs,
)
from paratrain.tools.doctor.rules.base import Rule

RULES: tuple[Rule, ...] = (
    *samplers.RULES,
    *output.RULES,
    *placement.RULES,
    *checkpoints.RULES,
    *syncs.RULES,
    *launching.RULES,
    *loading.RULES,
    *processes.RULES,
    *numerics.RULES,
    *multinode.RULES,
    *gradients.RULES,
)

__all__ = ["RULES", "Rule"]
