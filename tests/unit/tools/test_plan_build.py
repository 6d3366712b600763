"""plan traces a model whose constructor reads a number it computes (timm's stochastic
depth rates: ``torch.linspace(...).item()``), which fake tensors cannot give."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.tools.plan import trace_step


class _Rates(nn.Module):
    """Layers scaled by rates computed as timm's ViT computes its drop-path rates; the
    head tied to the first layer (one parameter, however the model is built)."""

    def __init__(self) -> None:
        super().__init__()
        self.rates = [x.item() for x in torch.linspace(0.0, 0.2, 3, device="cpu")]
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in self.rates)
        self.head = nn.Linear(64, 64)
        self.head.weight = self.layers[0].weight
        self.register_buffer("scale", torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for rate, layer in zip(self.rates, self.layers, strict=True):
            x = torch.relu(layer(x)) * (1 - rate) * self.scale
        return self.head(x)


def _build() -> Any:
    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 64), torch.randn(n, 64)

    model = _Rates()
    return model, nn.functional.mse_loss, lambda p: torch.optim.AdamW(p, lr=1e-3), sample


def test_a_model_whose_constructor_reads_a_computed_number_is_traced() -> None:
    """Predicted on fakes of the real-built model's tensors: the same peak as measured on
    real tensors, the tied weight counted once."""
    predicted = trace_step(_build, 32)
    measured = trace_step(_build, 32, fake=False)
    assert predicted.parameter_bytes == measured.parameter_bytes == (3 * 64 * 65 + 64) * 4
    assert abs(predicted.peak.total / measured.peak.total - 1) <= 0.15
    assert predicted.peak.optimizer == measured.peak.optimizer
