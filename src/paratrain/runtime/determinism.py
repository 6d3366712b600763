"""Reproducible runs: deterministic algorithms, no TF32, and a record of what a run used.

By default PyTorch on a GPU trades exactness for speed in two ways: cuDNN convolutions
round their fp32 inputs to TF32 (10-bit mantissa), and cuDNN and some CUDA kernels pick
algorithms whose floating-point sums run in a different order from one run to the next
(atomics, autotuning). ``deterministic=True`` turns both off, so the same seed gives the
same weights, bit for bit. On the CPU the defaults are already deterministic.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from paratrain.utils import environment
from paratrain.utils.errors import UserError

#: cuBLAS needs a fixed workspace to be deterministic; read when cuBLAS starts
CUBLAS_WORKSPACE_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"
T = TypeVar("T")
_NOT_DETERMINISTIC = re.compile(r"^(?P<op>.+?) does not have a deterministic implementation")


class DeterminismError(UserError):
    """An operation has no deterministic implementation, and determinism was asked for."""


def make_deterministic() -> None:
    """Deterministic algorithms everywhere, cuDNN without autotuning, TF32 off.

    Call it before the first CUDA operation of the process: cuBLAS reads its workspace
    setting when it starts (spawned processes inherit it from the environment).
    """
    environment.set_default(CUBLAS_WORKSPACE_VARIABLE, CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    _tf32_off()


def _tf32_off() -> None:
    # torch 2.9 added per-operator fp32_precision flags; setting the legacy allow_tf32 flags
    # after the new ones (or the reverse) raises, so use the newer API where it exists.
    cudnn: Any = torch.backends.cudnn  # flags the type stubs do not declare
    matmul: Any = torch.backends.cuda.matmul
    if hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        matmul.fp32_precision = "ieee"
        cudnn.conv.fp32_precision = "ieee"
        cudnn.rnn.fp32_precision = "ieee"
    else:
        matmul.allow_tf32 = False
        cudnn.allow_tf32 = False


def _tf32_flags() -> tuple[bool, bool]:
    """Whether CUDA matmuls and cuDNN convolutions may use TF32."""
    cudnn: Any = torch.backends.cudnn
    cuda_matmul: Any = torch.backends.cuda.matmul
    try:
        return bool(cuda_matmul.allow_tf32), bool(cudnn.allow_tf32)
    except RuntimeError:  # set through the per-operator flags, which alone can tell
        return cuda_matmul.fp32_precision == "tf32", cudnn.conv.fp32_precision == "tf32"


def numerics_settings() -> dict[str, Any]:
    """The settings that decide whether a run is reproducible (recorded in config.json)."""
    tf32_matmul, tf32_cudnn = _tf32_flags()
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "tf32_matmul": tf32_matmul,
        "tf32_cudnn_conv": tf32_cudnn,
        "cublas_workspace_config": environment.current().get(CUBLAS_WORKSPACE_VARIABLE),
    }


def nondeterministic_operation(exc: BaseException) -> DeterminismError | None:
    """PyTorch's refusal to run an operation without a deterministic implementation, as a
    one-line error naming the operation; None for any other exception."""
    if not isinstance(exc, RuntimeError):
        return None
    match = _NOT_DETERMINISTIC.match(str(exc))
    if match is None:
        return None
    return DeterminismError(
        f"{match['op']} has no deterministic implementation, which deterministic mode "
        "(--deterministic, Runtime(deterministic=True)) needs; run without it, or replace "
        "that operation in the model or loss"
    )


def naming_nondeterministic(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn``, with PyTorch's refusal of an operation that has no deterministic
    implementation turned into a one-line :class:`DeterminismError` naming it."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            error = nondeterministic_operation(exc)
            if error is None:
                raise
            raise error from None

    return call
