"""Models used by the examples and benchmarks, written here so torchvision is never needed."""

from __future__ import annotations

from paratrain.models.resnet import BasicBlock, ResNet, resnet18
from paratrain.models.small import DigitsCNN

__all__ = ["BasicBlock", "DigitsCNN", "ResNet", "resnet18"]
