"""Checkpoints: read any layout's weights safely, load them into any layout, inspect, convert.

report = paratrain.load_weights(model, "runs/x/model.safetensors")
"""

from __future__ import annotations

from paratrain.checkpoints.files.convert import ConvertResult, convert_checkpoint
from paratrain.checkpoints.files.formats import Checkpoint, latest_checkpoint, read_checkpoint
from paratrain.checkpoints.files.loading import load_weights
from paratrain.checkpoints.files.report import LoadReport, ShapeMismatch, WeightsMismatchError
from paratrain.checkpoints.files.summary import summarize

__all__ = [
    "Checkpoint",
    "ConvertResult",
    "LoadReport",
    "ShapeMismatch",
    "WeightsMismatchError",
    "convert_checkpoint",
    "latest_checkpoint",
    "load_weights",
    "read_checkpoint",
    "summarize",
]
