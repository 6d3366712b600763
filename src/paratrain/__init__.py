"""paratrain: train PyTorch models on any device layout with the same code."""

from __future__ import annotations

__version__ = "0.1.0"

from paratrain.errors import PlacementError, UserError
from paratrain.runtime import Runtime, RuntimeConfig
from paratrain.strategies import strategy_names


def strategies() -> list[str]:
    """The registered strategy names, ``auto`` first."""
    return strategy_names()


__all__ = [
    "PlacementError",
    "Runtime",
    "RuntimeConfig",
    "UserError",
    "__version__",
    "strategies",
]
