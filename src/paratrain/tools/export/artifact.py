"""A quantized model on disk, and ``load_quantized`` to run it again.

The file is a ``torch.save`` dict: the recipe and the run's settings (to rebuild the
model's layers) and the quantized state dict, whose weights are torchao tensor types.
It is read back with ``torch.load(weights_only=True)``: torch's restricted unpickler,
which builds tensors and only the classes registered as safe (torchao registers its
quantized tensor types when imported); a file naming anything else is refused, so no
pickled code runs.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoints.files.readers import pickled_globals
from paratrain.tools.export.torchao_api import import_torchao
from paratrain.training.config import TrainConfig, runtime_option_names
from paratrain.training.recipes import get_recipe
from paratrain.utils.atomic import atomic_write
from paratrain.utils.errors import UserError

FORMAT = "paratrain-quantized"
FORMAT_VERSION = 1


def settings_from(config: dict[str, Any]) -> TrainConfig:
    """The run's TrainConfig from ``config.json``'s ``config`` (unknown keys ignored)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)} | set(runtime_option_names())
    return TrainConfig.of(**{k: v for k, v in config.items() if k in known})


def save_quantized(
    path: Path, model: nn.Module, scheme: str, config: dict[str, Any], torchao: str
) -> None:
    payload = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "scheme": scheme,
        "recipe": config["recipe"],
        "config": {k: v for k, v in config.items() if isinstance(v, (str, int, float, bool))},
        "torchao": torchao,
        "state_dict": model.state_dict(),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def load_quantized(path: str | Path, map_location: str | torch.device | None = None) -> nn.Module:
    """The quantized model saved by ``paratrain export``, in eval mode, ready to run.

    ``model = paratrain.load_quantized("runs/digits/model-int8.pt"); model(x)``. Needs
    torchao (``pip install "paratrain[export]"``); int4 models load on a CUDA GPU.
    """
    import_torchao()  # registers torchao's tensor types as safe to load
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such file: {path}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        # torch's message advises weights_only=False: never the right advice for bad bytes.
        code = pickled_globals(path)
        if code:
            raise UserError(
                f"{path} holds objects that are refused when loading (GLOBAL "
                f"{', '.join(code[:3])}); none of it was run"
            ) from None
        raise UserError(
            f"{path} is not a quantized model written by paratrain export (not a valid "
            "torch.save file)"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise UserError(
            f"{path} is not a readable quantized model ({type(exc).__name__})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"{path} is not a model written by paratrain export")
    model = get_recipe(str(payload["recipe"])).build_model(settings_from(payload["config"]))
    # assign=True puts the saved torchao tensors in place of the float parameters.
    model.load_state_dict(payload["state_dict"], assign=True)
    return model.eval()
