"""Activation checkpointing per block: the same weights, less memory at the peak."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.models import GPT, resnet18
from paratrain.runtime.activation_checkpointing import apply_activation_checkpointing
from paratrain.tools.plan import trace_step


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, checkpointed: bool) -> nn.Module:
    rt = paratrain.Runtime("cpu", activation_checkpointing=checkpointed)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(3):
        loss = rt.forward_backward(model, _loss, x, y)
        assert torch.isfinite(loss)
        optimizer.step()
        optimizer.zero_grad()
    return model


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _same(a: nn.Module, b: nn.Module) -> float:
    first, second = a.state_dict(), b.state_dict()
    return max((first[k].double() - second[k].double()).abs().max().item() for k in first)


@pytest.mark.slow
def test_same_weights_and_batchnorm_statistics_on_cpu() -> None:
    """--strategy cpu: tiny-gpt (dropout: the rerun draws the same masks) and ResNet-18
    (BatchNorm: statistics counted once) train to the same state with and without."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 17))
    images, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    for build, x, y in (
        (lambda: GPT(width=32, depth=2), tokens[:, :-1], tokens[:, 1:]),
        (lambda: resnet18(num_classes=10), images, labels),
    ):
        torch.manual_seed(1)
        plain = _train(build(), x, y, checkpointed=False)
        torch.manual_seed(1)
        checkpointed = _train(build(), x, y, checkpointed=True)
        assert _same(plain, checkpointed) <= 1e-6
        marked = [m for m in checkpointed.modules() if getattr(m, "_paratrain_checkpointed", 0)]
        assert len(marked) >= 2  # the blocks: tiny-gpt's two, ResNet's four layers


@pytest.mark.slow
def test_plan_shows_the_memory_saved() -> None:
    """--strategy cpu tracing: checkpointing tiny-gpt's blocks lowers the activations at the
    peak (the figure `paratrain plan --activation-checkpointing` shows)."""

    def build(checkpointed: bool) -> object:
        def make() -> object:
            model = GPT(width=64, depth=4)
            if checkpointed:
                assert apply_activation_checkpointing(model) == 4
            tokens = torch.randint(0, 64, (16, 33))
            return (
                model,
                _loss,
                lambda p: torch.optim.SGD(p, lr=0.1),
                lambda n: (tokens[:n, :-1], tokens[:n, 1:]),
            )

        return make

    plain = trace_step(build(False), 16).peak  # type: ignore[arg-type]
    saved = trace_step(build(True), 16).peak  # type: ignore[arg-type]
    assert saved.activations < 0.7 * plain.activations


def test_dataparallel_is_refused() -> None:
    """--strategy dp-balanced on cpu,cpu: its replicas would run the original forward."""
    with pytest.raises(paratrain.UserError, match="does not work with --strategy dp-balanced"):
        paratrain.Runtime("dp-balanced", devices="cpu,cpu", activation_checkpointing=True)
