"""A Hugging Face decoder's pipeline stages built from its block list (no processes): the
stages hold the model's own modules under its names, chained they compute the model's
logits, and what they cannot do is refused in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paratrain.strategies.decoder_stages import tied_parameters
from paratrain.strategies.pipeline_plan import plan_stages
from paratrain.utils.errors import UserError

transformers = pytest.importorskip("transformers")


def _model(family: str, layers: int = 4) -> Any:
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=layers, n_head=2,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
            tie_word_embeddings=family == "llama-tied",
        )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama", "llama-tied"])
def test_stages_hold_the_model_under_its_names_and_chained_give_its_logits(family: str) -> None:
    model = _model(family)
    stages = plan_stages(model, 3)
    keys = [list(stage.state_dict()) for stage in stages]
    assert sorted(k for part in keys for k in part) == sorted(model.state_dict())
    assert keys[0][0] in ("transformer.wte.weight", "model.embed_tokens.weight")
    assert keys[-1][-1] == "lm_head.weight" and not any("lm_head" in k for k in keys[0])
    ids = torch.randint(64, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        value = ids
        for stage in stages:
            value = stage(value)
        assert torch.equal(value, model(ids).logits)
    tied = tied_parameters(stages)
    assert tied == ([model.lm_head.weight] if family != "llama" else [])


def test_stages_balance_the_parameters_or_start_at_the_named_blocks() -> None:
    model = _model("llama", layers=6)
    sizes = [sum(p.numel() for p in stage.parameters()) for stage in plan_stages(model, 2)]
    assert abs(sizes[0] - sizes[1]) < sum(p.numel() for p in model.model.layers[0].parameters())
    named = plan_stages(model, 3, ["model.layers.1", "model.layers.5"])
    held = [sorted({k.split(".")[2] for k in s.state_dict() if ".layers." in k}) for s in named]
    assert held == [["0"], ["1", "2", "3", "4"], ["5"]]


@pytest.mark.parametrize(
    ("stages", "split", "says"),
    [
        (5, (), "needs at least 5 blocks to split between, and GPT2LMHeadModel has 4"),
        (2, ("transformer.ln_f",), "is cut between its blocks; name blocks"),
        (3, ("transformer.h.2", "transformer.h.1"), "in the order the model runs them"),
        (2, ("transformer.h.0",), "name blocks after the first"),
    ],
)
def test_a_cut_the_decoder_cannot_take_is_one_line(
    stages: int, split: tuple[str, ...], says: str
) -> None:
    with pytest.raises(UserError, match=says):
        plan_stages(_model("gpt2"), stages, split)


def test_a_stage_refuses_a_padding_mask_or_a_cache_and_takes_a_mask_of_ones() -> None:
    stage = plan_stages(_model("gpt2"), 2)[0]
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert stage.options_refused({"attention_mask": torch.ones_like(ids)}) is None
    padded = torch.ones_like(ids)
    padded[0, -2:] = 0
    assert "padding attention_mask" in stage.options_refused({"attention_mask": padded})
    refused = stage.options_refused({"past_key_values": object(), "use_cache": True})
    assert refused.startswith("past_key_values, use_cache: the pipeline's stages take token ids")


def test_a_decoder_of_another_family_is_refused_with_advice_that_works() -> None:
    """Mistral shares Llama's layout, but its forward is not the one written out: it goes
    to tracing, which cannot follow it; the advice names the layouts that train it."""
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserError) as refused:
        plan_stages(model, 2)
    message = str(refused.value)
    assert "could not follow MistralForCausalLM.forward" in message and "\n" not in message
    assert "--strategy fsdp" in message and "GPT-2 and Llama" in message
    assert "top-level modules" not in message  # the old advice: it fails the same way
