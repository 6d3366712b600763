"""How many bytes the tensors inside an object take: a model's output, a checkpoint's state."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj``: a tensor, or tensors nested in dicts, lists,
    tuples and dataclasses (a Hugging Face ``ModelOutput`` is a dict and a dataclass)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(value) for value in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0
