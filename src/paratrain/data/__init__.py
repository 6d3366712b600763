"""Data sets used by the examples and benchmarks, loaded without torchvision or scikit-learn."""

from __future__ import annotations

from paratrain.data.cifar import (
    CIFAR_FILES,
    CIFAR_MEAN,
    CIFAR_STD,
    load_cifar10,
    synthetic_cifar10,
    write_fake_cifar_batches,
)
from paratrain.data.digits import load_digits_split

__all__ = [
    "CIFAR_FILES",
    "CIFAR_MEAN",
    "CIFAR_STD",
    "load_cifar10",
    "load_digits_split",
    "synthetic_cifar10",
    "write_fake_cifar_batches",
]
