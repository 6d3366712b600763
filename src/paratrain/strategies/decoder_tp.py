"""Tensor parallelism (``--tp N``) for Hugging Face decoders, from the model's own plan.

A Transformers configuration carries its base model's tensor-parallel plan
(``base_model_tp_plan``: ``{"layers.*.self_attn.q_proj": "colwise", ...,
"layers.*.mlp.down_proj": "rowwise"}``). Each entry becomes torch's ``ColwiseParallel`` or
``RowwiseParallel`` on the layers it names, applied with ``parallelize_module`` on the ``tp``
mesh dimension before fsdp shards the rest (:mod:`.tensor_parallel`). The embeddings, norms
and head are not in that plan and stay whole on every process of a group (Transformers' own
runtime adds the embedding and head to it, and newer releases put the embedding's
``embedding_rowwise`` and the norms' ``replicated_*`` in the plan itself; paratrain keeps them
whole, tied or not).

The attention of the types checked here (Llama, Mistral, Qwen2) keeps q, k and v apart and
reshapes their outputs with ``view(*shape, -1, head_dim)``: each process's projections give
its heads / N query heads and key-value heads / N key-value heads, read from the width, and
the ratio of the two (``num_key_value_groups``) is the model's. Nothing is fused, so each
split is a plain ``Shard`` (no ``_StridedShard``). Other types are refused: an attention that
reads the global head count would train another model, silently.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any

from torch import nn

from paratrain.utils.errors import UserError

if TYPE_CHECKING:  # torch.distributed.tensor loads torch._dynamo: imported when used
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

#: the plan styles applied (Transformers' names), as torch's styles
STYLES = ("colwise", "rowwise")
#: styles newer Transformers give the embedding and norms (``embedding_rowwise``,
#: ``replicated_with_grad_allreduce``): paratrain keeps those modules whole instead
KEPT_WHOLE = (nn.Embedding,)
#: the model types whose attention reads its local head count from the split widths
CHECKED_TYPES = ("llama", "mistral", "qwen2")


def is_decoder(model: nn.Module) -> bool:
    """Whether ``model`` is a Transformers model (it has a configuration with a type)."""
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)


def layer_plan(model: nn.Module) -> dict[str, str]:
    """The model's plan by layer name (``model.layers.0.self_attn.q_proj``: ``colwise``);
    ``UserError`` where it has none, or one that paratrain does not apply."""
    config: Any = getattr(model, "config", None)
    name = type(model).__name__
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise UserError(
            f"--tp: {name}'s config carries no tensor-parallel plan (base_model_tp_plan); "
            f"{_no_plan_note(config)}drop --tp"
        )
    if config.model_type not in CHECKED_TYPES:
        raise UserError(
            f"--tp: {name} has a plan, but paratrain has checked the attention of "
            f"{', '.join(CHECKED_TYPES)} models only (that it reads its local head count); "
            "drop --tp"
        )
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    modules = dict(model.named_modules())
    layers: dict[str, str] = {}
    for pattern, style in plan.items():
        matched = [n for n in modules if _matches(n, base + pattern)]
        if style not in STYLES and _kept_whole(style, [modules[n] for n in matched]):
            continue
        if style not in STYLES:
            raise UserError(
                f"--tp: {name}'s plan splits {pattern} as {style!r}, which paratrain does not "
                f"apply (it applies {' and '.join(STYLES)}); drop --tp"
            )
        for layer in matched:
            if not isinstance(modules[layer], nn.Linear):
                raise UserError(
                    f"--tp: {name}'s plan splits {layer} ({type(modules[layer]).__name__}) "
                    f"as {style!r}; paratrain splits linear layers only; drop --tp"
                )
            layers[layer] = style
    return layers


def _kept_whole(style: str, matched: list[nn.Module]) -> bool:
    """Whether a plan entry splits an embedding (or replicates a module) that paratrain
    keeps whole on every process of a group anyway."""
    if style.startswith("replicated"):
        return True
    return style.startswith("embedding") and all(isinstance(m, KEPT_WHOLE) for m in matched)


def check(model: nn.Module, tp: int, shards: int) -> None:
    """``UserError`` unless ``model``'s plan applies and its heads, key-value heads and MLP
    width split into ``tp`` groups, and each split layer's rows into ``shards`` fsdp shards."""
    layers = layer_plan(model)
    config: Any = getattr(model, "config", None)
    heads = config.num_attention_heads
    widths = {
        "attention heads": heads,
        "key-value heads": getattr(config, "num_key_value_heads", None) or heads,
        "MLP width (intermediate_size)": config.intermediate_size,
    }
    for what, count in widths.items():
        if count % tp:
            raise UserError(
                f"--tp {tp} does not divide the {count} {what} of {type(model).__name__}; "
                f"use a --tp that divides {count}"
            )
    modules = dict(model.named_modules())
    for name, style in layers.items():
        linear = modules[name]
        assert isinstance(linear, nn.Linear)
        rows = linear.out_features // tp if style == "colwise" else linear.out_features
        if rows % shards:
            raise UserError(
                f"--tp {tp} leaves {shards} fsdp shards, which do not divide the {rows} rows "
                f"each process holds of {name}; use a --tp that does"
            )


def parallelize(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split ``model``'s planned layers across the processes of ``mesh`` (``tp``)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # each output's last dimension is split (colwise) or each input's (rowwise), so the
    # attention's reshapes and the MLP's products run on this process's part as they are
    styles: dict[str, type[ParallelStyle]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
    }
    plan = {name: styles[style]() for name, style in layer_plan(model).items()}
    parallelize_module(model, mesh, plan)


def _matches(name: str, pattern: str) -> bool:
    """``name`` is ``pattern`` with each ``*`` one part of a dotted name (Transformers')."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(
        fnmatch.fnmatchcase(part, want) for part, want in zip(parts, wanted, strict=True)
    )


def _no_plan_note(config: Any) -> str:
    if getattr(config, "model_type", None) == "gpt2":
        return (
            "GPT-2's attention is one fused Conv1D (c_attn), whose columns a plain split "
            "would cut across q, k and v; "
        )
    return ""
