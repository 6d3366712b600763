"""Strategies, one module each, registered by name on import."""

from __future__ import annotations

import torch

from paratrain.devices import cuda_count, mps_available
from paratrain.strategies import cpu, cuda, dp, dp_balanced, mps  # noqa: F401  (registration)
from paratrain.strategies.base import Collective, Strategy
from paratrain.strategies.registry import (
    AUTO,
    describe_strategies,
    register,
    strategy_class,
    strategy_names,
)

__all__ = [
    "AUTO",
    "Collective",
    "Strategy",
    "build_strategy",
    "describe_strategies",
    "register",
    "resolve_auto",
    "strategy_class",
    "strategy_names",
]


def resolve_auto(devices: str | None) -> str:
    """The strategy ``auto`` stands for on this machine: cuda, else mps, else cpu."""
    if cuda_count() > 0:
        return "cuda"
    if mps_available():
        return "mps"
    return "cpu"


def build_strategy(name: str, devices: str | int | None) -> Strategy:
    """Validate ``name`` and ``devices`` and build the strategy (no process group yet)."""
    spec = None if devices is None else str(devices)
    if name == AUTO:
        name = resolve_auto(spec)
    cls = strategy_class(name)
    resolved: list[torch.device] = cls.resolve_devices(spec)
    return cls(resolved)
