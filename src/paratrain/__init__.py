"""paratrain: train PyTorch models on any device layout with the same code."""

from __future__ import annotations

# first, for its side effect: the command's OpenMP threads sleep while they wait
from paratrain import wait_policy  # noqa: F401
from paratrain.checkpoint import LoadReport, WeightsMismatchError, load_weights
from paratrain.errors import PlacementError, UserError
from paratrain.export import load_quantized
from paratrain.runtime import Runtime, RuntimeConfig
from paratrain.strategies import strategy_names
from paratrain.tensorboard_logger import TensorBoardLogger
from paratrain.version import __version__


def strategies() -> list[str]:
    """The registered strategy names, ``auto`` first."""
    return strategy_names()


__all__ = [
    "LoadReport",
    "PlacementError",
    "Runtime",
    "RuntimeConfig",
    "TensorBoardLogger",
    "UserError",
    "WeightsMismatchError",
    "__version__",
    "load_quantized",
    "load_weights",
    "strategies",
]
