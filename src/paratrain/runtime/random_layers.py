"""Layers that draw random numbers in training (dropout): each process draws from its own
generator, so a layout with several devices trains a model of the same distribution as one
process, not the same weights. ``rt.setup`` says so once, rather than let a comparison of
layouts fail without a reason."""

from __future__ import annotations

from torch import nn
from torch.nn.modules.dropout import _DropoutNd


def dropout_note(model: nn.Module, devices: int) -> str | None:
    """The note for ``model`` trained on ``devices`` devices, or None (one device, or no
    dropout that draws)."""
    if devices < 2:
        return None
    rates = [m.p for m in model.modules() if isinstance(m, _DropoutNd) and m.p > 0]
    attention = getattr(getattr(model, "config", None), "attention_dropout", 0.0)
    if isinstance(attention, float) and attention > 0:  # Hugging Face: inside attention
        rates.append(attention)
    if not rates:
        return None
    layers = f"{len(rates)} dropout layer{'s' if len(rates) != 1 else ''}"
    return (
        f"the model has dropout ({layers}, p up to {max(rates):g}): each of the {devices} "
        "devices draws its own masks, so this layout trains a model of the same distribution "
        "as one process, not the same weights (p=0 makes layouts comparable)"
    )
