"""Models used by the examples and benchmarks, written here so torchvision is never needed."""

from __future__ import annotations

from paratrain.models.gpt import GPT, TokenCrossEntropy, TransformerBlock
from paratrain.models.resnet import BasicBlock, ResNet, resnet18
from paratrain.models.small import DigitsCNN

__all__ = [
    "GPT",
    "BasicBlock",
    "DigitsCNN",
    "ResNet",
    "TokenCrossEntropy",
    "TransformerBlock",
    "resnet18",
]
