"""A small CNN for the 8x8 digits set.

It has no BatchNorm and no dropout on purpose: both make the result depend on how a
batch is split across devices (per-device statistics, per-device random masks), and
this model is used to check that every data-parallel layout gives the same answer.
"""

from __future__ import annotations

from torch import Tensor, nn


class DigitsCNN(nn.Module):
    """Two 3x3 convs, one 2x2 max pool and two linear layers, for 1x8x8 inputs, 10 classes."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))
