"""fsdp x tensor parallel's mesh (shard x tp) and its refusals, without processes: the
training itself runs in tests/integration/test_fsdp_tp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli import main_in_process
from torch import nn

from paratrain.distributed.mesh import SHARD, TP, mesh_names, mesh_shape
from paratrain.models import GPT
from paratrain.runtime.config import RuntimeConfig
from paratrain.strategies import decoder_tp
from paratrain.strategies.tensor_parallel import check_tp_model
from paratrain.utils.errors import UserError


@pytest.mark.parametrize(
    ("world_size", "tp", "shape"), [(4, 2, (2, 2)), (8, 2, (4, 2)), (8, 4, (2, 4)), (4, 4, (1, 4))]
)
def test_tp_groups_are_the_inner_dimension(
    world_size: int, tp: int, shape: tuple[int, ...]
) -> None:
    assert mesh_shape(world_size, tp=tp) == shape
    assert mesh_names(shape, tp) == (SHARD, TP)


@pytest.mark.parametrize(
    ("world_size", "replicate", "tp", "message"),
    [
        (4, 1, 3, "--tp 3 does not divide the 4 processes into equal groups; use one of 1, 2, 4"),
        (4, 1, 0, "--tp must be at least 1, got 0"),
        (4, 2, 2, "--tp with --replicate is not built yet; drop one of them"),
    ],
)
def test_a_tp_that_does_not_fit_is_refused(
    world_size: int, replicate: int, tp: int, message: str
) -> None:
    with pytest.raises(UserError) as caught:
        mesh_shape(world_size, replicate, tp)
    assert str(caught.value) == message


def test_tp_reaches_fsdp_and_is_refused_elsewhere() -> None:
    config = RuntimeConfig.of(strategy="fsdp", devices="cpu,cpu,cpu,cpu", tp=2)
    assert config.options.tp == 2
    for name in ("ddp", "cpu", "pipeline"):
        with pytest.raises(UserError) as caught:
            RuntimeConfig.of(strategy=name, tp=2)
        assert str(caught.value) == (
            f"--tp applies to --strategy fsdp only, not {name}; drop --tp or use --strategy fsdp"
        )


def test_only_the_built_in_gpt_with_heads_that_split_is_taken() -> None:
    check_tp_model(GPT(width=64, heads=4), tp=2, shards=2)
    with pytest.raises(UserError) as caught:
        check_tp_model(nn.Sequential(nn.Linear(4, 4)), tp=2, shards=2)
    assert str(caught.value) == (
        "--tp has a plan for paratrain's built-in GPT (paratrain.models.gpt.GPT, --recipe "
        "tiny-gpt) and Hugging Face decoders (Llama, Mistral, Qwen2) only, not Sequential; "
        "drop --tp"
    )
    with pytest.raises(UserError, match="--tp 8 does not divide the GPT's 4 attention heads"):
        check_tp_model(GPT(width=64, heads=4), tp=8, shards=1)
    with pytest.raises(UserError, match="leaves 3 fsdp shards, which do not divide the GPT's"):
        check_tp_model(GPT(width=64, heads=4), tp=2, shards=3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ("--recipe", "digits", "--strategy", "fsdp", "--devices", "cpu,cpu,cpu,cpu"),
            "--tp has a plan for paratrain's built-in GPT",
        ),
        (
            ("--recipe", "tiny-gpt", "--strategy", "ddp", "--devices", "cpu,cpu"),
            "--tp applies to --strategy fsdp only, not ddp",
        ),
    ],
)
def test_bad_tp_is_one_line_and_exit_2_before_any_process(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, options: tuple[str, ...], message: str
) -> None:
    out = tmp_path / "bad"
    code, _, err = main_in_process(capfd, "train", *options, "--tp", 2, "--out", out)
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()


def _llama(**sizes: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **sizes}))


def test_the_embedding_and_norms_of_a_newer_plan_stay_whole() -> None:
    """Newer Transformers put ``embed_tokens: embedding_rowwise`` and the norms in the plan:
    the embedding stays whole, as with an older plan; the same layers are split."""
    model = _llama()
    older = decoder_tp.layer_plan(model)
    model.config.base_model_tp_plan = {
        "embed_tokens": "embedding_rowwise",
        **model.config.base_model_tp_plan,
        "norm": "replicated_with_grad_allreduce",
    }
    assert decoder_tp.layer_plan(model) == older
    model.config.base_model_tp_plan = {"layers.*.self_attn.o_proj": "embedding_rowwise"}
    with pytest.raises(UserError, match="o_proj as 'embedding_rowwise', which paratrain"):
        decoder_tp.layer_plan(model)


def test_a_llama_is_split_by_its_own_plan() -> None:
    """The config's plan by layer: q, k, v and the MLP's gate and up column-wise, the
    attention's output and the MLP's down row-wise; embeddings, norms and head not."""
    model = _llama()
    check_tp_model(model, tp=2, shards=2)
    plan = decoder_tp.layer_plan(model)
    assert len(plan) == 2 * 7
    assert plan["model.layers.1.self_attn.k_proj"] == "colwise"
    assert plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert not any("embed" in name or "norm" in name or "lm_head" in name for name in plan)


@pytest.mark.parametrize(
    ("sizes", "tp", "shards", "message"),
    [
        ({}, 3, 1, "--tp 3 does not divide the 4 attention heads of LlamaForCausalLM; use a "
         "--tp that divides 4"),
        ({}, 4, 1, "--tp 4 does not divide the 2 key-value heads of LlamaForCausalLM; use a "
         "--tp that divides 2"),
        ({"num_key_value_heads": 4, "intermediate_size": 66}, 4, 1, "--tp 4 does not divide "
         "the 66 MLP width (intermediate_size) of LlamaForCausalLM; use a --tp that divides 66"),
        ({}, 2, 3, "--tp 2 leaves 3 fsdp shards, which do not divide the 16 rows each process "
         "holds of model.layers.0.self_attn.q_proj; use a --tp that does"),
    ],
)  # fmt: skip
def test_a_llama_whose_widths_do_not_split_is_refused(
    sizes: dict[str, int], tp: int, shards: int, message: str
) -> None:
    with pytest.raises(UserError) as caught:
        check_tp_model(_llama(**sizes), tp=tp, shards=shards)
    assert str(caught.value) == message


def test_a_decoder_without_a_plan_or_with_a_style_not_applied_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(UserError) as caught:
        check_tp_model(gpt2, tp=2, shards=1)
    assert str(caught.value) == (
        "--tp: GPT2LMHeadModel's config carries no tensor-parallel plan (base_model_tp_plan); "
        "GPT-2's attention is one fused Conv1D (c_attn), whose columns a plain split would cut "
        "across q, k and v; drop --tp"
    )
    llama = _llama()
    llama.config.base_model_tp_plan = {
        **llama.config.base_model_tp_plan,
        "layers.*.self_attn.o_proj": "rowwise_split_input",
    }
    with pytest.raises(UserError) as caught:
        check_tp_model(llama, tp=2, shards=1)
    assert str(caught.value) == (
        "--tp: LlamaForCausalLM's plan splits layers.*.self_attn.o_proj as "
        "'rowwise_split_input', which paratrain does not apply (it applies colwise and "
        "rowwise); drop --tp"
    )
    qwen3 = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        )
    )  # fmt: skip
    with pytest.raises(UserError, match="Qwen3ForCausalLM has a plan, but paratrain has checked"):
        check_tp_model(qwen3, tp=2, shards=1)


def test_a_gpt2_recipe_under_tp_is_one_line_and_exit_2(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "bad"
    code, _, err = main_in_process(
        capfd, "train", "--recipe", "hf:gpt2", "--strategy", "fsdp", "--devices", "cpu,cpu",
        "--tp", 2, "--out", out,
    )  # fmt: skip
    assert code == 2
    assert "GPT2LMHeadModel's config carries no tensor-parallel plan" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()
