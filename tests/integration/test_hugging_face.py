"""Hugging Face Transformers models on every layout, as a user's loop trains them:
``model(input_ids, labels=input_ids).loss``, AdamW, ``rt.setup_loader``. Tiny GPT-2 (its head
tied to the word embedding) and Llama configs, built from their configs on the CPU: the
weights after six steps on ddp, fsdp (the default blocks: the model's ``_no_split_modules``)
and dp-balanced (the model's own loss on each device) must be one process's within 1e-5, and
the saved weights load with ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.cli.main import main
from paratrain.utils.errors import UserError

pytestmark = pytest.mark.slow  # real processes
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5


def _config(family: str) -> Any:
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    if family == "mistral":
        return transformers.MistralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip


def _train(rt: paratrain.Runtime, family: str, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(64, (48, 16), generator=torch.Generator().manual_seed(0))
    for (ids,) in rt.setup_loader(DataLoader(TensorDataset(tokens), batch_size=8)):
        if rt.strategy.trains_in_pipeline:  # forward and backward together: the model's loss
            rt.forward_backward(model, None, ids, ids)
        else:
            rt.backward(model(ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # evaluation as on one process: .logits and the model's own .loss
        model.eval()
        outputs = model(tokens[:8], labels=tokens[:8])
    rt.save_weights(model, path)
    return outputs.logits, outputs.loss


_ONE_PROCESS: dict[str, tuple[dict[str, torch.Tensor], Any]] = {}


def _one_process(family: str, folder: Path) -> tuple[dict[str, torch.Tensor], Any]:
    if family not in _ONE_PROCESS:
        path = folder / f"{family}-cpu.safetensors"
        outputs = paratrain.Runtime(strategy="cpu", seed=0).launch(_train, family, str(path))
        _ONE_PROCESS[family] = load_file(str(path)), outputs
    return _ONE_PROCESS[family]


@pytest.mark.parametrize(
    ("family", "strategy"),
    [
        ("gpt2", "ddp"),
        ("gpt2", "fsdp"),
        ("gpt2", "dp-balanced"),
        ("llama", "fsdp"),
        ("llama", "pipeline"),
    ],
)
def test_a_hugging_face_model_trains_the_same_on_two_cpu_devices(
    family: str, strategy: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """pipeline: the loop's rt.forward_backward(model, None, ids, ids) trains on the model's
    own loss, the last stage computing it; the tied head's two copies (first and last
    stage) stay one weight; evaluation gets .logits and .loss on every process."""
    folder = tmp_path_factory.mktemp(f"{family}-{strategy}")
    reference, (logits, loss) = _one_process(family, tmp_path_factory.getbasetemp())
    path = folder / "model.safetensors"
    outputs = paratrain.Runtime(strategy=strategy, devices="cpu,cpu", seed=0).launch(
        _train, family, str(path)
    )
    weights = load_file(str(path))
    assert weights.keys() == reference.keys()
    diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
    print(f"\n{family} {strategy} --devices cpu,cpu vs cpu after 6 steps: max abs diff {diff:.3g}")
    assert diff < TOLERANCE
    if strategy == "pipeline":
        assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
        rank_logits, rank_loss = outputs  # rank 0's: the first stage, given the last's output
        assert (rank_logits - logits).abs().max().item() < TOLERANCE
        assert abs(rank_loss.item() - loss.item()) < TOLERANCE
    # the run's weights are a Hugging Face checkpoint: config.json beside them
    _config(family).save_pretrained(folder)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    state = loaded.state_dict()
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


def test_pipeline_refuses_a_decoder_it_does_not_cut_and_names_what_works(tmp_path: Path) -> None:
    """--strategy pipeline --devices cpu,cpu on Mistral (Llama's layout, not its forward):
    refused at setup in one line that names the layouts that do train it."""
    rt = paratrain.Runtime(strategy="pipeline", devices="cpu,cpu", seed=0)
    with pytest.raises(UserError, match=r"MistralForCausalLM.forward .* --strategy fsdp"):
        rt.launch(_train, "mistral", str(tmp_path / "model.safetensors"))


_FACTORY = """
import torch
import transformers
from torch import nn


def build():
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.AutoModelForCausalLM.from_config(config)

    def loss_fn(out, ids):
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten())

    def sample(n):
        ids = torch.randint(64, (n, 16))
        return ids, ids

    return model, loss_fn, sample
"""


def test_plan_of_gpt2_has_a_row_per_layout_that_trains_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`paratrain plan --script` on GPT-2 (its output a ModelOutput): rows for cpu, ddp, fsdp
    and pipeline (which cuts it at its blocks), and no refusal."""
    script = tmp_path / "gpt2.py"
    script.write_text(_FACTORY)
    argv = ["plan", "--script", f"{script}:build", "--batch-size", "8", "--accelerator", "cpu"]
    assert main([*argv, "--devices", "2", "--json"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert [row["layout"] for row in plan["layouts"]] == ["cpu", "ddp", "fsdp", "pipeline"]
    assert "pipeline" not in plan["refused"]


_TINY_GPT2 = {
    "model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64,
    "vocab_size": 96, "bos_token_id": 0, "eos_token_id": 0,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}  # fmt: skip


def test_the_hf_recipe_trains_the_same_on_fsdp_and_saves_what_from_pretrained_loads(
    tmp_path: Path, paratrain_here: Any
) -> None:
    """`paratrain train --recipe hf:CONFIG` with a local config.json: cpu here, fsdp on
    cpu,cpu (default blocks: GPT-2's `_no_split_modules`) within 1e-5 after 8 steps; each
    run's `hf/` folder loads with `from_pretrained`, the head still tied."""
    config = tmp_path / "tiny-gpt2.json"
    config.write_text(json.dumps(_TINY_GPT2))
    weights = {}
    for strategy, devices in (("cpu", "cpu"), ("fsdp", "cpu,cpu")):
        out = tmp_path / strategy
        done = paratrain_here(
            "train", "--recipe", f"hf:{config}", "--strategy", strategy, "--devices", devices,
            "--max-steps", "8", "--out", str(out), "--no-progress",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        weights[strategy] = load_file(str(out / "model.safetensors"))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
        assert type(loaded).__name__ == "GPT2LMHeadModel"
        state = loaded.state_dict()
        assert all(torch.equal(state[k], v) for k, v in weights[strategy].items())
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    one, two = weights["cpu"], weights["fsdp"]
    assert one.keys() == two.keys()
    assert max((one[k] - two[k]).abs().max().item() for k in one) < TOLERANCE


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("missing.json", "does not exist"),
        ("broken.json", "is not a JSON config"),
        ("untyped.json", "names no model_type"),
        ("no-such-model-type", "no Transformers model type of that name"),
    ],
)
def test_a_wrong_hf_recipe_is_one_line(
    spec: str, says: str, tmp_path: Path, paratrain_here: Any
) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "untyped.json").write_text('{"n_layer": 2}')
    done = paratrain_here("train", "--recipe", f"hf:{spec}", "--max-steps", "1")
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_hf_recipe_trains_the_same_under_pipeline_and_resumes_exactly(
    tmp_path: Path, paratrain_here: Any
) -> None:
    """`paratrain train --recipe hf:CONFIG --strategy pipeline --devices cpu,cpu` (GPT-2, its
    head tied to the word embedding, cut at its blocks): within 1e-5 of one process after
    8 steps, the two copies of the tied weight identical, the `hf/` folder loading with
    `from_pretrained`; resumed from its step-4 checkpoint, the run ends bit-identical."""
    config = tmp_path / "tiny-gpt2.json"
    config.write_text(json.dumps(_TINY_GPT2))
    common = ("train", "--recipe", f"hf:{config}", "--max-steps", "8", "--no-progress")
    weights = {}
    for strategy, devices in (("cpu", "cpu"), ("pipeline", "cpu,cpu")):
        done = paratrain_here(
            *common, "--strategy", strategy, "--devices", devices, "--save-every", "4",
            "--out", strategy,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        weights[strategy] = load_file(str(tmp_path / strategy / "model.safetensors"))
    one, two = weights["cpu"], weights["pipeline"]
    assert one.keys() == two.keys()
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    print(f"\nhf:gpt2 pipeline --devices cpu,cpu vs cpu after 8 steps: max abs diff {diff:.3g}")
    assert diff < TOLERANCE
    assert torch.equal(two["lm_head.weight"], two["transformer.wte.weight"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pipeline" / "hf")
    assert torch.equal(loaded.state_dict()["lm_head.weight"], two["lm_head.weight"])
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    (tmp_path / "pipeline/checkpoints/step-000008").rename(tmp_path / "step-000008")
    (tmp_path / "pipeline/model.safetensors").unlink()  # the resumed run writes its own
    resumed = paratrain_here("train", "--resume", "pipeline/checkpoints/step-000004")
    assert resumed.returncode == 0, resumed.stderr
    again = load_file(str(tmp_path / "pipeline" / "model.safetensors"))
    assert again.keys() == two.keys() and all(torch.equal(again[k], two[k]) for k in two)
