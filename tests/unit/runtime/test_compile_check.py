"""`--compile` checked: the first step's compiled gradients against eager ones.

Devices: `--strategy cpu` in this process (agree, disagree through the test hook, strict,
and the real torch 2.13 inductor bug on a tiny Conv-ReLU-Conv-ReLU-MaxPool network; bf16
gradients judged against float32, with dynamo's eager backend); `ddp`
with one gloo process on `cpu` (the layout whose gradients DDP averages). Compiling is slow
on a CPU: the models are tiny and each shape is compiled once per test.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import pytest
import torch
from paratrain_test_faults import COMPILE_FAULT_VARIABLE
from torch import nn

import paratrain
from paratrain.distributed.collective import Collective
from paratrain.runtime.compile_check import TOLERANCES, CompileCheck
from paratrain.utils import injection
from paratrain.utils.errors import UserError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(rt: paratrain.Runtime, net: nn.Module, x: torch.Tensor) -> tuple[nn.Module, dict]:
    """One compiled training step; the model and the gradients it left."""
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    y = torch.arange(len(x)) % 2
    rt.backward(nn.functional.cross_entropy(model(x), y))
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    optimizer.step()
    return model, grads


def _eager_grads(net: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    net.zero_grad()
    nn.functional.cross_entropy(net(x), torch.arange(len(x)) % 2).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}


@pytest.mark.slow
def test_agreeing_gradients_keep_the_compiled_model_and_a_fault_falls_back(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--strategy cpu: agree (compiled kept), disagree (eager from the first step), strict."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    rt = paratrain.Runtime(strategy="cpu", compile=True)
    model, _ = _step(rt, _mlp(), x)
    check = rt.speed.check
    assert check is not None and check.state == "agreed" and check.worst[1] < 1e-3
    assert "gradients agree with eager" in capsys.readouterr().err

    monkeypatch.setenv(COMPILE_FAULT_VARIABLE, "zero-grads")  # compiled first weight: no grad
    rt = paratrain.Runtime(strategy="cpu", compile=True)
    net = _mlp()
    expected = _eager_grads(_mlp(), x)
    model, grads = _step(rt, net, x)
    assert rt.speed.check is not None and rt.speed.check.state == "fell back"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "worst: 0.weight, relative difference 1" in err
    assert "training goes on without compile" in err
    for name, grad in expected.items():  # the step trained with eager gradients
        torch.testing.assert_close(grads[name], grad)
    assert rt.describe()["compile_check"]["state"] == "fell back"
    with torch.no_grad():  # later forwards run eager: the same outputs, not the compiled ones
        torch.testing.assert_close(model(x), net(x), rtol=0, atol=0)

    rt = paratrain.Runtime(strategy="cpu", compile="strict")
    with pytest.raises(UserError, match="--compile strict stops here"):
        _step(rt, _mlp(), x)


@pytest.mark.slow
def test_the_inductor_bug_on_convolutions_falls_back_to_eager(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--strategy cpu: torch 2.13's CPU inductor gives these convolutions zero gradients."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 10),  # with 10 outputs (not 2) the bug shows
    )
    x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    rt = paratrain.Runtime(strategy="cpu", compile=True)
    _, grads = _step(rt, net, x)
    assert rt.speed.check is not None
    if rt.speed.check.state == "agreed":
        pytest.skip(f"torch {torch.__version__} compiles these convolutions correctly")
    assert rt.speed.check.state == "fell back"
    assert "worst: 0." in capsys.readouterr().err  # a convolution's parameter
    assert bool(grads["0.weight"].abs().sum() > 0)  # the step trained them after all


@pytest.mark.slow
def test_ddp_compares_with_averaged_eager_gradients() -> None:
    """ddp on cpu (one gloo process): the compiled DDP(model) agrees with eager."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    rt = paratrain.Runtime(strategy="ddp", devices="cpu", compile=True)
    _step(rt, _mlp(), x)
    assert rt.speed.check is not None and rt.speed.check.state == "agreed"
    rt.teardown()
    torch._dynamo.utils.counters.clear()  # compiled DDP's own graph breaks: not the next test's


class _Output(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class _OwnLoss(nn.Module):
    """Hugging Face's idiom: ``model(x, labels=y)`` returns the loss beside the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> _Output:
        logits = self.net(x)
        return _Output(nn.functional.cross_entropy(logits, labels), logits)


@pytest.mark.slow
def test_a_model_that_computes_its_own_loss_is_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--strategy cpu: the compiled graph ends in the loss, so the logits get no gradient."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    rt = paratrain.Runtime(strategy="cpu", compile=True)
    net = _OwnLoss()
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    rt.forward_backward(model, None, x, torch.arange(len(x)) % 2)
    optimizer.step()
    check = rt.speed.check
    assert check is not None and check.state == "agreed", capsys.readouterr().err
    assert "gradients agree with eager" in capsys.readouterr().err


# -- bf16: compiled and eager round differently; float32 tells which is further off ------------
def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def _bf16() -> AbstractContextManager[Any]:
    return torch.autocast("cpu", torch.bfloat16)


def _bf16_step(handler: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> CompileCheck:
    """One bf16 step of :func:`_bn_net` checked, its "compiled" gradients ``handler``'s."""
    net = _bn_net()
    compiled = torch.compile(net, backend="eager")  # the graph as dynamo captures it, no inductor
    check = CompileCheck(
        compiled,
        strict=False,
        precision="bf16",
        collective=Collective(),
        autocast=_bf16,
        compile_time=lambda: (1, 0.0),
    )
    x, y = _images()
    with injection.injected("compiled_grads", handler), _bf16():
        loss = nn.functional.cross_entropy(compiled(x), y)
    with injection.injected("compiled_grads", handler):
        loss.backward()
        check.after_backward()
    return check


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(16, 3, 8, 8, generator=generator), torch.randint(
        0, 10, (16,), generator=generator
    )


def _float32_grads() -> list[torch.Tensor]:
    net = _bn_net()
    x, y = _images()
    nn.functional.cross_entropy(net(x), y).backward()
    return [p.grad.clone() for p in net.parameters()]


def test_gradients_closer_to_float32_than_eager_bf16_keep_the_compiled_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--strategy cpu, bf16: a compiler that computes in float32 where eager rounds to bf16
    (inductor does so for BatchNorm) differs from eager by more than the tolerance, yet is
    no further from float32: kept, and the line says why."""
    exact = _float32_grads()
    check = _bf16_step(lambda grads: exact)
    assert check.worst[1] > TOLERANCES["bf16"]  # the plain comparison alone would refuse
    assert check.rounding is not None and check.rounding.within
    assert check.rounding.compiled < check.rounding.eager
    assert check.state == "agreed"
    err = capsys.readouterr().err
    assert "no more than bf16's own rounding" in err and "from float32" in err


def test_a_wrong_gradient_under_bf16_still_falls_back(capsys: pytest.CaptureFixture[str]) -> None:
    """--strategy cpu, bf16: a parameter without its gradient is further from float32 than
    any rounding: eager from the first step, the line naming both distances."""
    exact = _float32_grads()
    check = _bf16_step(lambda grads: [torch.zeros_like(exact[0]), *exact[1:]])
    assert check.rounding is not None and not check.rounding.within
    assert check.rounding.name == "0.weight" and check.rounding.compiled == pytest.approx(1)
    assert check.state == "fell back"
    err = capsys.readouterr().err
    assert "worst: 0.weight" in err and "from float32, 0.weight's compiled gradients are 1" in err
