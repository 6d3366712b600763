"""The few torchao calls export needs, behind one import that says how to install it.

torchao is an extra (``pip install "paratrain[export]"``). Importing it logs warnings about
CUDA-only kernels that a CPU build cannot load; they are silenced because nothing here
uses them.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import torch
from torch import nn

from paratrain.utils.errors import UserError

MISSING_TORCHAO = 'quantization needs torchao: pip install "paratrain[export]"'
SCHEMES = ("int8", "int4")
#: what each scheme is, in the report
DESCRIPTIONS = {
    "int8": "int8 weights, activations quantized to int8 at run time (dynamic)",
    "int4": "int4 weights (groups of 128), bfloat16 activations (weight-only)",
}
INT4_GROUP = 128


def import_torchao() -> ModuleType:
    """``torchao.quantization``, imported quietly; ``UserError`` where torchao is missing.

    Importing torchao also registers its quantized tensor types as safe for
    ``torch.load(weights_only=True)``, which is how quantized files are read back.
    """
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.quantization as quantization
    except ImportError:
        raise UserError(MISSING_TORCHAO) from None
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return quantization


def torchao_version() -> str:
    import_torchao()
    import torchao

    return str(torchao.__version__)


def int4_unsupported() -> str | None:
    """Why int4 weight-only quantization cannot run here (None: it may)."""
    if not torch.cuda.is_available():
        return (
            "int4 weight-only needs a CUDA GPU: torchao's int4 kernels (tinygemm, mslk) have "
            "no CPU version; use --int8 on the CPU"
        )
    return None


def device_for(scheme: str) -> torch.device:
    """Where a model quantized with ``scheme`` runs: int8 on the CPU, int4 on the GPU."""
    return torch.device("cuda:0") if scheme == "int4" else torch.device("cpu")


def quantizable(model: nn.Module) -> list[str]:
    """The layers the schemes quantize: every ``nn.Linear`` (convolutions stay float)."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return [name or "(the whole model)" for name in linears]


def _config(quantization: ModuleType, scheme: str) -> Any:
    if scheme == "int8":
        return quantization.Int8DynamicActivationInt8WeightConfig()
    return quantization.Int4WeightOnlyConfig(
        group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d"
    )


def quantize(model: nn.Module, scheme: str) -> nn.Module:
    """Quantize ``model``'s Linear layers in place (it must be on ``device_for(scheme)``)."""
    quantization = import_torchao()
    if scheme == "int4":
        reason = int4_unsupported()
        if reason is not None:
            raise UserError(reason)
        model.to(torch.bfloat16)  # the int4 kernels take bfloat16 activations
    try:
        quantization.quantize_(model, _config(quantization, scheme))
    except (RuntimeError, ValueError, AssertionError, ImportError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"torchao cannot quantize this model to {scheme}: {first}") from None
    return model
