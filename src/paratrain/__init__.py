"""paratrain: train PyTorch models on any device layout with the same code."""

from __future__ import annotations

import copyreg
import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# first, for its side effect: the command's OpenMP threads sleep while they wait
from paratrain.launching import wait_policy  # noqa: F401
from paratrain.utils.errors import PlacementError, UserError
from paratrain.version import __version__

if TYPE_CHECKING:
    from paratrain.checkpoints.files import LoadReport, WeightsMismatchError, load_weights
    from paratrain.runtime.facade import Runtime, RuntimeConfig
    from paratrain.tools.export import load_quantized
    from paratrain.training.tensorboard_logger import TensorBoardLogger

#: the public names that need torch, and where each lives: imported on first use, so that
#: `import paratrain` and `paratrain --help` start without loading torch
_LAZY = {
    "LoadReport": "paratrain.checkpoints.files",
    "WeightsMismatchError": "paratrain.checkpoints.files",
    "load_weights": "paratrain.checkpoints.files",
    "load_quantized": "paratrain.tools.export",
    "Runtime": "paratrain.runtime.facade",
    "RuntimeConfig": "paratrain.runtime.facade",
    "TensorBoardLogger": "paratrain.training.tensorboard_logger",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Strategies:
    """``paratrain.strategies()``: the registered strategy names, ``auto`` first; and the
    strategies with their options, ``paratrain.strategies.FSDP(blocks=("Block",))``
    (:mod:`paratrain.strategies.choices`), imported on first use."""

    def __call__(self) -> list[str]:
        from paratrain.strategies import strategy_names

        return strategy_names()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        module = importlib.import_module("paratrain.strategies")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"paratrain.strategies has no attribute {name!r}") from None

    def __dir__(self) -> list[str]:
        return list(importlib.import_module("paratrain.strategies").__all__)

    def __repr__(self) -> str:
        return "<paratrain.strategies>"


strategies = _Strategies()


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        # Importing the subpackage paratrain.strategies binds its name here; the name stays
        # the function strategies() (the subpackage is in sys.modules), as it always was.
        if name == "strategies" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


# pickled by name, as plain modules are (Ray ships a trainable that refers to paratrain)
def _by_name(module: _Package) -> tuple[Any, tuple[str]]:
    return importlib.import_module, (module.__name__,)


copyreg.pickle(_Package, _by_name)

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
