"""Precision policies; fp16 gradients are unscaled before clipping, so that clipping then
gives the model fp32 gives.

A GradScaler multiplies the loss (by 65,536 at first) so that fp16 gradients do not
underflow; until ``optimizer.step()`` the gradients stay multiplied. Clipping them without
``rt.unscale_gradients(optimizer)`` would clip values that much too large and shrink every
step by the scale. paratrain uses a GradScaler for fp16 on CUDA only; torch's CPU GradScaler
is the same class, so these tests put one into the CPU precision policy (``--strategy cpu``)
and check the arithmetic that CUDA runs.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import NamedTuple

import pytest
import torch
from torch import nn

import paratrain
from paratrain.devices.precision import (
    Precision,
    normalize_precision,
    precision_unavailable_reason,
    to_float32,
)
from paratrain.runtime.optim import RuntimeOptimizer
from paratrain.runtime.step_state import StepState
from paratrain.utils.errors import UserError

CPU = torch.device("cpu")
MAX_NORM = 0.05
LR = 0.5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=generator), torch.randn(16, 2, generator=generator)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 2)


def _grad_norm(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _fp32_clipped_steps(steps: int) -> tuple[nn.Module, list[float]]:
    """The reference: plain fp32 SGD steps with clipping; the norms clipping saw."""
    model, (x, y) = _model(), _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
    return model, norms


def _assert_same_model(model: nn.Module, reference: nn.Module, initial: nn.Module) -> None:
    for p, r, p0 in zip(
        model.parameters(), reference.parameters(), initial.parameters(), strict=True
    ):
        moved = (r - p0).abs().max().item()
        assert moved > 1e-3  # the steps changed the model: a shrunken step would show
        torch.testing.assert_close(p, r, rtol=0, atol=moved * 1e-3)


def test_precision_unscale_before_clipping_matches_fp32() -> None:
    """``--strategy cpu``: Precision("fp16") with a GradScaler, clipped steps = fp32's."""
    reference, norms = _fp32_clipped_steps(3)
    assert min(norms) > 10 * MAX_NORM  # clipping acts on every step
    model, (x, y) = _model(), _data()
    initial = copy.deepcopy(model)
    precision = Precision("fp16", CPU)
    precision.scaler = torch.amp.GradScaler("cpu")  # what fp16 on CUDA builds
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for norm in norms:
        optimizer.zero_grad()
        precision.backward(nn.functional.mse_loss(model(x), y))  # fp32 forward: exact
        assert _grad_norm(model) > 1000 * norm  # scaled, until unscaled
        precision.unscale(optimizer)
        assert abs(_grad_norm(model) - norm) < 1e-4 * norm
        nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        precision.optimizer_step(optimizer)
    _assert_same_model(model, reference, initial)


def test_runtime_optimizer_unscales_through_its_accumulation() -> None:
    """``--strategy cpu``: RuntimeOptimizer.unscale_gradients under accumulation (2 micro-
    batches per step), unscaled once per applied step."""
    reference, norms = _fp32_clipped_steps(2)
    model, (x, y) = _model(), _data()
    initial = copy.deepcopy(model)
    precision = Precision("fp16", CPU)
    precision.scaler = torch.amp.GradScaler("cpu")
    accumulation = StepState(2)
    optimizer = RuntimeOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), precision, accumulation
    )
    for _ in norms:
        optimizer.zero_grad()
        for xs, ys in zip(x.split(8), y.split(8), strict=True):
            precision.backward(nn.functional.mse_loss(model(xs), ys) / 2)
            accumulation.micro_batch_done()
        assert accumulation.sync_gradients
        optimizer.unscale_gradients()
        nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    _assert_same_model(model, reference, initial)


def _runtime_fp16_clipped(rt: paratrain.Runtime, steps: int) -> nn.Module:
    """The README's clipping loop: ``rt.unscale_gradients`` then ``clip_grad_norm_``."""
    model, (x, y) = _model(), _data()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    for _ in range(steps):
        optimizer.zero_grad()
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.unscale_gradients(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    return model


def test_rt_unscale_gradients_under_fp16_autocast_matches_fp32() -> None:
    """``--strategy cpu --precision fp16`` (autocast), with a GradScaler as on CUDA: clipped
    steps close to fp32's; without a scaler (fp32) it does nothing."""
    reference, _ = _fp32_clipped_steps(3)
    initial = _model()
    rt = paratrain.Runtime(strategy="cpu", precision="fp16")
    # A scale this small model's fp16 backward does not overflow at: no step is skipped.
    rt.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model = _runtime_fp16_clipped(rt, 3)
    assert rt.precision.scaler.get_scale() == 2.0**10  # no overflow, no skipped step
    for p, r, p0 in zip(
        model.parameters(), reference.parameters(), initial.parameters(), strict=True
    ):
        moved = (r - p0).abs().max().item()
        torch.testing.assert_close(p, r, rtol=0, atol=moved * 0.02)  # fp16 forward
    plain = _runtime_fp16_clipped(paratrain.Runtime(strategy="cpu", precision="32"), 3)
    for p, r in zip(plain.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, r)


def test_every_spelling_of_a_precision_names_one_policy() -> None:
    spellings = {
        "32": ["32", "fp32", "32-true", "FP32", 32],
        "bf16": ["bf16", "bf16-mixed", "BF16"],
        "fp16": ["fp16", "16", "16-mixed", 16],
    }
    for name, aliases in spellings.items():
        assert [normalize_precision(a) for a in aliases] == [name] * len(aliases)
    with pytest.raises(
        UserError, match=r"unknown precision 'fp8'; valid precisions: 32, bf16, fp16"
    ):
        normalize_precision("fp8")


def test_autocast_needs_a_device_type_that_has_it() -> None:
    """A device type without autocast (``meta`` here): only --precision 32 runs on it."""
    meta = torch.device("meta")
    assert isinstance(Precision("32", meta).autocast(), contextlib.nullcontext)
    for name in ("bf16", "fp16"):
        with pytest.raises(
            UserError,
            match=f"--precision {name}: autocast is not available on meta; use --precision 32",
        ):
            Precision(name, meta)


def test_accelerator_device_types_have_autocast_and_fp16_on_cuda_a_scaler() -> None:
    """Device types only (no GPU is used): ``cuda`` and ``mps`` have autocast, fp16 on
    ``cuda`` steps through a GradScaler (disabled where CUDA is absent)."""
    for device in (torch.device("cuda"), torch.device("mps")):
        for name in ("32", "fp16"):
            assert precision_unavailable_reason(name, device) is None, (name, device)
    assert precision_unavailable_reason("bf16", torch.device("mps")) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available. Disabling"
        fp16 = Precision("fp16", torch.device("cuda"))
    assert isinstance(fp16.scaler, torch.amp.GradScaler) and fp16.scaler._device == "cuda"
    assert Precision("fp16", torch.device("mps")).scaler is None
    assert Precision("32", torch.device("cuda")).scaler is None


def test_the_cpu_policies_dtypes_and_scaler() -> None:
    """``--strategy cpu``: autocast dtypes; a GradScaler only for fp16 on CUDA."""
    assert [Precision(n, CPU).dtype for n in ("32", "bf16", "fp16")] == [
        None,
        torch.bfloat16,
        torch.float16,
    ]
    assert all(Precision(n, CPU).scaler is None for n in ("32", "bf16", "fp16"))
    with Precision("bf16", CPU).autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")
    with Precision("fp16", CPU).autocast():
        assert torch.get_autocast_dtype("cpu") == torch.float16
    with Precision("32", CPU).autocast():
        assert not torch.is_autocast_enabled("cpu")
    model = nn.Linear(2, 2)
    forward = model.forward
    assert Precision("32", CPU).wrap_forward(model).forward == forward  # untouched
    seen: list[torch.dtype] = []
    model.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    out = Precision("bf16", CPU).wrap_forward(nn.Sequential(model))(torch.ones(1, 2))
    assert (seen, out.dtype) == ([torch.bfloat16], torch.float32)


class _Pair(NamedTuple):
    logits: torch.Tensor
    ids: torch.Tensor


def test_outputs_leave_autocast_as_float32_in_the_same_containers() -> None:
    half, ids = torch.ones(2, dtype=torch.float16), torch.arange(2)
    out = to_float32({"a": [half, (half, ids)], "b": _Pair(half, ids), "c": "text"})
    assert isinstance(out["b"], _Pair) and isinstance(out["a"], list)
    assert isinstance(out["a"][1], tuple)
    assert [out["a"][0].dtype, out["a"][1][0].dtype, out["b"].logits.dtype] == [torch.float32] * 3
    assert out["a"][1][1].dtype == out["b"].ids.dtype == torch.int64  # not floating: kept
    assert out["c"] == "text"
    assert torch.equal(out["b"].logits, torch.ones(2))


def test_a_closure_reaches_the_scaler_which_refuses_it() -> None:
    """``--strategy cpu`` with a GradScaler: ``optimizer.step(closure)`` is not ignored
    silently (torch's GradScaler says it does not support closures)."""
    model = _model()
    precision = Precision("fp16", CPU)
    precision.scaler = torch.amp.GradScaler("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    precision.backward(model(torch.ones(1, 6)).sum())
    with pytest.raises(RuntimeError, match=r"[Cc]losure"):
        precision.optimizer_step(optimizer, closure=lambda: torch.tensor(0.0))
