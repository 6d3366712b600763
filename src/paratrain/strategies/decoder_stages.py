"""Pipeline stages of a Hugging Face decoder built from its block list, not by tracing.

Transformers' forwards (masks, caches, ``ModelOutput``) cannot be followed by ``torch.fx``,
but a causal language model of GPT-2's or Llama's layout is embeddings, a list of blocks, a
final norm and a head. Each stage holds some of the blocks, the first the embeddings too,
the last the norm and the head, under the model's own names, and its forward calls them as
the model's own forward does for a plain training batch: token ids in, no padding mask, no
cache. Where the head is tied to the word embedding (GPT-2's ``lm_head.weight`` is
``wte.weight``), the first and last stage each hold the one parameter; the pipeline sums
its two gradients after the backward (:mod:`.pipelined_model`).

Only the model types whose forward is written out here are recognised: a type of the same
layout whose forward differs (Gemma scales its embeddings) would train a different model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

#: what a stage passes on: one hidden-state tensor; the last stage's output is the logits
Tensor = torch.Tensor


@dataclass(frozen=True)
class DecoderLayout:
    """Where a decoder keeps its parts, as names under the model."""

    family: str
    embeddings: tuple[str, ...]
    blocks: str
    norm: str
    rotary: str | None = None
    head: str = "lm_head"


#: the model classes whose forward :class:`DecoderStage` writes out, by class name
_LAYOUTS = {
    "GPT2LMHeadModel": DecoderLayout(
        "gpt2", ("transformer.wte", "transformer.wpe", "transformer.drop"), "transformer.h",
        "transformer.ln_f",
    ),
    "LlamaForCausalLM": DecoderLayout(
        "llama", ("model.embed_tokens",), "model.layers", "model.norm", "model.rotary_emb"
    ),
}  # fmt: skip

SUPPORTED = tuple(_LAYOUTS)


def decoder_layout(model: nn.Module) -> DecoderLayout | None:
    """The layout of ``model`` when it is a causal LM of a type written out here."""
    layout = _LAYOUTS.get(type(model).__name__)
    if layout is None or getattr(model, "config", None) is None:
        return None
    modules = dict(model.named_modules())
    names = [*layout.embeddings, layout.blocks, layout.norm, layout.head]
    if layout.rotary is not None:
        names.append(layout.rotary)
    if any(name not in modules for name in names):
        return None
    return layout if isinstance(modules[layout.blocks], nn.ModuleList) else None


def unsupported_config(model: nn.Module, layout: DecoderLayout) -> str | None:
    """Why the configuration needs what the stages do not do, if it does."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "add_cross_attention", False):
        return "it has cross-attention (add_cross_attention)"
    if layout.family == "llama" and getattr(config, "num_hidden_layers", None) != len(
        model.get_submodule(layout.blocks)  # type: ignore[arg-type]
    ):
        return "its config runs fewer layers than it holds"
    return None


def block_names(model: nn.Module, layout: DecoderLayout) -> list[str]:
    blocks = model.get_submodule(layout.blocks)
    return [f"{layout.blocks}.{index}" for index in range(len(blocks))]  # type: ignore[arg-type]


def segment_weights(model: nn.Module, layout: DecoderLayout) -> list[int]:
    """Parameters of each block; the first block counts the embeddings, the last the final
    norm and the head (a tied head too: the last stage holds it as well)."""

    def count(name: str) -> int:
        return sum(p.numel() for p in model.get_submodule(name).parameters())

    weights = [count(name) for name in block_names(model, layout)]
    weights[0] += sum(count(name) for name in layout.embeddings)
    weights[-1] += count(layout.norm) + count(layout.head)
    return weights


def build_stages(model: nn.Module, layout: DecoderLayout, starts: Sequence[int]) -> list[nn.Module]:
    """One stage per run of blocks: ``starts`` are the indices (after 0) where stages 2, 3,
    ... begin."""
    names = block_names(model, layout)
    bounds = [0, *starts, len(names)]
    count = len(bounds) - 1
    return [
        DecoderStage(model, layout, names[bounds[i] : bounds[i + 1]], i == 0, i == count - 1)
        for i in range(count)
    ]


def _cache_keyword(function: Callable[..., Any]) -> str:
    """What this Transformers version calls the key/value cache argument: ``cache`` (as in
    5.24) or ``past_key_values`` (as in 5.17 and the versions before)."""
    parameters = inspect.signature(function).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def attach(root: nn.Module, qualified: str, module: nn.Module) -> None:
    """``module`` under ``root`` at the dotted name ``qualified``, with empty containers on
    the way: the stage's state dict keys are the model's."""
    *path, leaf = qualified.split(".")
    parent = root
    for part in path:
        if part not in parent._modules:
            parent.add_module(part, nn.Module())
        parent = parent._modules[part]  # type: ignore[assignment]
    parent.add_module(leaf, module)


class DecoderStage(nn.Module):
    """Some blocks of a decoder, with the embeddings on the first stage and the final norm
    and head on the last, called as the model's forward calls them."""

    #: the model's configuration (not a module: plain attributes)
    config: Any
    _causal_mask: Callable[..., Any]

    def __init__(
        self,
        model: nn.Module,
        layout: DecoderLayout,
        blocks: Sequence[str],
        first: bool,
        last: bool,
    ) -> None:
        super().__init__()
        from transformers.masking_utils import create_causal_mask

        self.layout, self.first, self.last = layout, first, last
        self.block_names = list(blocks)
        names = list(blocks)
        if first:
            names = [*layout.embeddings, *names]
        if layout.rotary is not None:
            names.append(layout.rotary)  # every stage computes the position embeddings
        if last:
            names += [layout.norm, layout.head]
        for name in names:
            attach(self, name, model.get_submodule(name))
        object.__setattr__(self, "config", getattr(model, "config", None))
        object.__setattr__(self, "_causal_mask", create_causal_mask)
        # no key/value cache, by the name this Transformers version gives it
        self._no_cache = {_cache_keyword(create_causal_mask): None}
        block_forward = model.get_submodule(blocks[0]).forward if blocks else create_causal_mask
        self._block_no_cache = {_cache_keyword(block_forward): None}

    def forward(self, hidden: Tensor) -> Tensor:
        """Token ids (first stage) or the hidden states the stage before returned; the next
        hidden states, or (last stage) the logits."""
        length = hidden.shape[1]
        positions = torch.arange(length, device=hidden.device).unsqueeze(0)
        if self.first:
            hidden = self._embed(hidden, positions)
        # masks and rotary embeddings follow the weights' dtype, as the model's forward
        # makes them from its embeddings' output
        reference = hidden.to(next(self.parameters()).dtype)
        mask = self._causal_mask(
            config=self.config,
            inputs_embeds=reference,
            attention_mask=None,
            position_ids=positions,
            **self._no_cache,
        )
        if self.layout.family == "gpt2":
            for name in self.block_names:
                block = self.get_submodule(name)
                hidden = block(
                    hidden, attention_mask=mask, encoder_hidden_states=None,
                    encoder_attention_mask=None, use_cache=False, position_ids=positions,
                    **self._block_no_cache,
                )  # fmt: skip
        else:
            assert self.layout.rotary is not None
            rotary = self.get_submodule(self.layout.rotary)(reference, position_ids=positions)
            for name in self.block_names:
                hidden = self.get_submodule(name)(
                    hidden, attention_mask=mask, position_embeddings=rotary,
                    position_ids=positions, use_cache=False, **self._block_no_cache,
                )  # fmt: skip
        if not self.last:
            return hidden
        hidden = self.get_submodule(self.layout.norm)(hidden)
        logits: Tensor = self.get_submodule(self.layout.head)(hidden)
        return logits

    def _embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        if ids.is_floating_point():
            raise TypeError("the first stage of a decoder takes token ids")
        if self.layout.family == "gpt2":
            wte, wpe, drop = (self.get_submodule(name) for name in self.layout.embeddings)
            embedded: Tensor = wte(ids)
            moved: Tensor = drop(embedded + wpe(positions).to(embedded.device))
            return moved
        tokens: Tensor = self.get_submodule(self.layout.embeddings[0])(ids)
        return tokens

    # -- what the pipeline asks of a stage ---------------------------------------------------
    def present(self, logits: Tensor) -> Any:
        """The last stage's output as the model gives it: a ``CausalLMOutputWithPast``
        (``.logits``), so a loss function or evaluation that reads ``.logits`` runs as on one
        process."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=logits)

    def own_loss(self, logits: Tensor, labels: Tensor, items: int) -> Tensor:
        """The model's own loss (labels shifted inside, as ``model(ids, labels=ids).loss``)
        summed over this micro-batch's tokens and divided by the whole batch's ``items``:
        the micro-batches' losses add up to the batch's."""
        from transformers.loss.loss_utils import LOSS_MAPPING

        causal_lm_loss = cast(Callable[..., Tensor], LOSS_MAPPING["ForCausalLM"])
        count = torch.tensor(items, device=logits.device)
        loss = causal_lm_loss(
            logits=logits, labels=labels, vocab_size=self.config.vocab_size,
            num_items_in_batch=count,
        )  # fmt: skip
        return loss

    def label_count(self, labels: Tensor) -> int:
        """The tokens a causal LM's loss counts in ``labels``: every position but the first
        of each row, except those set to -100 (Transformers' ignore index)."""
        return int((labels[..., 1:] != -100).sum())

    def options_refused(self, options: dict[str, Any]) -> str | None:
        """Why the stages cannot take these keyword arguments of the model's forward, if
        they cannot: they take token ids alone (an attention mask of ones is the same)."""
        mask = options.get("attention_mask")
        if mask is not None and not bool((mask == 1).all()):
            return (
                "a padding attention_mask (zeros in it): the pipeline's stages attend "
                "causally to every token; train on sequences without padding"
            )
        given = [
            k for k, v in options.items() if k not in ("attention_mask", "labels") and v is not None
        ]
        if given:
            return (
                f"{', '.join(sorted(given))}: the pipeline's stages take token ids alone (no "
                "cache, past_key_values, position_ids or embeddings)"
            )
        return None


def tied_parameters(stages: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Parameters that the first and the last stage both hold (a tied head)."""
    first = {id(p): p for p in stages[0].parameters()}
    return [p for p in stages[-1].parameters() if id(p) in first]
