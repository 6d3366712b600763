"""The registry of doctor's rules, one module per family."""

from __future__ import annotations

from paratrain.doctor.rules import (
    checkpoints,
    launching,
    loading,
    output,
    placement,
    samplers,
    syncs,
)
from paratrain.doctor.rules.base import Rule

RULES: tuple[Rule, ...] = (
    *samplers.RULES,
    *output.RULES,
    *placement.RULES,
    *checkpoints.RULES,
    *syncs.RULES,
    *launching.RULES,
    *loading.RULES,
)

__all__ = ["RULES", "Rule"]
