"""Quantized copies of trained models (torchao), and the call that runs them again.

report = export_model("runs/digits", scheme="int8")   # writes runs/digits/model-int8.pt
model = load_quantized("runs/digits/model-int8.pt")
"""

from __future__ import annotations

from paratrain.tools.export.artifact import load_quantized
from paratrain.tools.export.run import ExportReport, export_model

__all__ = ["ExportReport", "export_model", "load_quantized"]
