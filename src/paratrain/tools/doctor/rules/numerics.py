"""Mixed precision: clipping gradients that the GradScaler has not unscaled yet."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor.names import dotted
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.script import Script

_SCALERS = (
    "torch.cuda.amp.GradScaler",
    "torch.amp.GradScaler",
    "torch.GradScaler",
    "torch.cuda.amp.grad_scaler.GradScaler",
    "torch.amp.grad_scaler.GradScaler",
)
_CLIPS = ("clip_grad_norm_", "clip_grad_value_")


def _calls_on(script: Script, scope: ast.AST, owners: set[str], attr: str) -> list[ast.Call]:
    return [
        call
        for call in script.method_calls(attr)
        if script.scope(call) is scope
        and isinstance(call.func, ast.Attribute)
        and dotted(call.func.value) in owners
    ]


def _clip_before_unscale(script: Script) -> Iterator[Hit]:
    scalers = script.instances(*_SCALERS)
    if not scalers:
        return
    for attr in _CLIPS:
        for clip in script.method_calls(attr):
            if not (script.full_name(clip.func) or "").startswith("torch.nn.utils."):
                continue
            scope = script.scope(clip)
            scaled = [
                c for c in _calls_on(script, scope, scalers, "scale") if script.leads_to(c, clip)
            ]
            unscaled = [  # in any branch before the clip: silence over a guess
                c for c in _calls_on(script, scope, scalers, "unscale_") if c.lineno < clip.lineno
            ]
            if scaled and not unscaled:
                scaler = dotted(scaled[-1].func.value) or "scaler"  # type: ignore[attr-defined]
                yield Hit(
                    clip,
                    f"{attr} clips gradients that {scaler}.scale(loss) multiplied by the loss "
                    "scale (65536 at first): the threshold is compared with scaled norms, so it "
                    "clips far too hard, or never",
                    f"call {scaler}.unscale_(optimizer) before clipping (paratrain: "
                    "optimizer.unscale_gradients())",
                )


RULES = [
    Rule(
        "clip-before-unscale",
        "gradients clipped under AMP without scaler.unscale_(optimizer) first",
        _clip_before_unscale,
    )
]
