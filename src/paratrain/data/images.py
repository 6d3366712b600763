"""Images kept as bytes and normalised when read: 4x less memory than float32, and batches
that travel to the device as bytes.

Normalising reads a per-channel table of the 256 possible values, computed once with the
float32 arithmetic of ``(p / 255 - mean[c]) / std[c]``. A lookup gives the very same floats
on any device and for a sample or a batch alike, which arithmetic on a GPU would not promise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

_VALUES = 256


def normalization_table(mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``table[c, p] = (p / 255 - mean[c]) / std[c]`` in float32, computed as CIFAR-10's
    loader always did: numpy's float32 division, then torch's float32 subtract and divide."""
    values = torch.from_numpy(np.arange(_VALUES, dtype=np.uint8).astype(np.float32) / 255.0)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(-1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(-1, 1)
    return (values.view(1, _VALUES) - mean_t) / std_t


class NormalizedImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """uint8 images ``(N, C, H, W)`` and their labels; samples come out normalised float32.

    Follows :class:`paratrain.data.tensor_data.BatchRows`: ``tensors`` holds the bytes and the
    labels, and ``transform_batch`` normalises a whole batch wherever it is.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean: Sequence[float],
        std: Sequence[float],
    ) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4 or images.size(1) != len(mean):
            raise ValueError(f"expected uint8 images (N, {len(mean)}, H, W), got {images.dtype}")
        if labels.size(0) != images.size(0):
            raise ValueError(f"{images.size(0)} images but {labels.size(0)} labels")
        self.tensors = (images, labels)
        self.table = normalization_table(mean, std)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self.tensors[0].size(0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.tensors
        return self.normalize(images[index]), labels[index]

    def transform_batch(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[bytes (B, C, H, W), labels]`` -> ``[float32 images, labels]``, on their device."""
        images, labels = rows
        return [self.normalize(images), labels]

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``(..., C, H, W)`` -> float32 of the same shape, on the same device."""
        table, offsets = self._table_on(images.device)
        return table.take(images.long() + offsets)

    def _table_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:  # copied once per device, not per batch
            channels = self.table.size(0)
            offsets = (torch.arange(channels) * _VALUES).view(channels, 1, 1)
            self._tables[device] = (self.table.flatten().to(device), offsets.to(device))
        return self._tables[device]
