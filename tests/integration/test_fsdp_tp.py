"""fsdp x tensor parallel (``--strategy fsdp --tp 2``) over 4 real gloo processes on the CPU:
the built-in GPT split by heads and MLP width in pairs, sharded over the pairs, trains the
model one process trains, and its checkpoint resumes on one process; over 2, one step's
gradients are one process's. A Hugging Face Llama split by its own plan, over 2 and 4
processes, likewise, its weights loading with ``from_pretrained``. Refusals and the mesh's
shape: tests/unit/distributed/test_mesh.py and tests/unit/strategies/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.checkpoints.weights import plain_state_dict
from paratrain.data.tokens import markov_tokens
from paratrain.distributed.dtensors import full, is_sharded
from paratrain.models import GPT, TokenCrossEntropy
from paratrain.training.recipes import GPT_CONTEXT, GPT_DEPTH, GPT_HEADS, GPT_VOCAB, GPT_WIDTH

TOLERANCE = 1e-5
STEPS, SAVED_AT, BATCH = 16, 8, 16
LLAMA_STEPS, LLAMA_SAVED_AT = 8, 4


def _train(rt: paratrain.Runtime, folder: str, resume: bool) -> list[tuple[int, ...]]:
    """SGD with momentum on tiny-gpt's model and language; saves the whole state at step
    SAVED_AT (or starts from it) and the weights at the end. What this process holds of the
    first block's qkv and MLP weights."""
    torch.manual_seed(0)
    model = GPT(GPT_VOCAB, GPT_WIDTH, GPT_DEPTH, GPT_HEADS, GPT_CONTEXT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    state = Path(folder) / "state.pt"
    if resume:
        rt.load(state, {"model": model, "optimizer": optimizer})
    loader = rt.setup_loader(DataLoader(markov_tokens(STEPS * BATCH, GPT_CONTEXT), BATCH))
    loss_fn = TokenCrossEntropy()
    for step, (x, y) in enumerate(loader, start=1):
        if resume and step <= SAVED_AT:
            continue
        rt.backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if step == SAVED_AT and not resume:
            rt.save(state, {"model": model, "optimizer": optimizer})
    rt.save_weights(model, Path(folder) / ("resumed.safetensors" if resume else "end.safetensors"))
    params = dict(model.named_parameters())
    held = [params[f"blocks.0.{name}.weight"] for name in ("qkv", "mlp.0", "mlp.2")]
    return [tuple(w.to_local().shape if is_sharded(w) else w.shape) for w in held]


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _one_step(rt: paratrain.Runtime) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """tiny-gpt's model before a step, gathered whole, and its gradients after one."""
    torch.manual_seed(0)
    model = rt.setup(GPT(GPT_VOCAB, GPT_WIDTH, GPT_DEPTH, GPT_HEADS, GPT_CONTEXT))
    x, y = markov_tokens(BATCH, GPT_CONTEXT)[:]
    rt.backward(TokenCrossEntropy()(model(x), y))
    grads = {name: full(p.grad).cpu() for name, p in model.named_parameters()}
    return plain_state_dict(model), grads


def test_tp_2_gathers_the_plain_weights_and_one_process_gradients() -> None:
    """One step on a 1 x 2 mesh (the layers split in two, fsdp over one row): the gathered
    weights are the plain ones (qkv's rows are cut in each of q, k and v), and the gathered
    gradients one process's, the fused qkv's bias included (each process's slice of it)."""
    weights, grads = paratrain.Runtime(strategy="cpu", seed=0).launch(_one_step)  # type: ignore[misc]
    split = paratrain.Runtime(strategy="fsdp", devices="cpu,cpu", tp=2, seed=0)
    split_weights, split_grads = split.launch(_one_step)  # type: ignore[misc]
    assert _diff(split_weights, weights) == 0
    assert grads["blocks.0.qkv.bias"].abs().min() > 0  # every head's slice has a gradient
    assert _diff(split_grads, grads) < 1e-6


@pytest.mark.slow
def test_fsdp_x_tp_2x2_trains_one_process_model_and_resumes_on_one(tmp_path: Path) -> None:
    """16 steps on a shard x tp mesh of 2 x 2 reach one process's weights, each process
    holding a quarter of the split layers; the step-8 checkpoint, resumed on one process to
    step 16, ends there too."""
    one, tp = tmp_path / "one", tmp_path / "tp"
    one.mkdir(), tp.mkdir()
    paratrain.Runtime(strategy="cpu", seed=0).launch(_train, str(one), False)
    rt = paratrain.Runtime(strategy="fsdp", devices="cpu,cpu,cpu,cpu", tp=2, seed=0)
    assert rt.strategy.describe()["mesh"] == {"shard": 2, "tp": 2}
    held = rt.launch(_train, str(tp), False)
    # split in 2 by tp (qkv's and fc1's rows, fc2's columns), then in 2 by fsdp (qkv along
    # its input, the others along their rows)
    assert held == [(192 // 2, 64 // 2), (256 // 4, 64), (64 // 2, 256 // 2)]
    paratrain.Runtime(strategy="cpu", seed=0).launch(_train, str(tp), True)

    expected = load_file(str(one / "end.safetensors"))
    trained, resumed = (
        load_file(str(tp / "end.safetensors")),
        load_file(str(tp / "resumed.safetensors")),
    )
    saved = torch.load(tp / "state.pt", weights_only=True)["model"]
    assert all(saved[k].shape == v.shape for k, v in expected.items())  # plain full tensors
    print(
        f"\nfsdp x tp 2x2 vs cpu after {STEPS} steps: max |dw| {_diff(trained, expected):.3g}; "
        f"saved at {SAVED_AT}, resumed on cpu: {_diff(resumed, expected):.3g}"
    )
    assert _diff(trained, expected) < TOLERANCE
    assert _diff(resumed, expected) < TOLERANCE


def _llama_config(tied: bool) -> Any:
    """A tiny Llama: 4 query heads sharing 2 key-value heads (grouped-query attention)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tied,
    )  # fmt: skip


def _train_llama(
    rt: paratrain.Runtime, folder: str, tied: bool, adamw: bool, resume: bool = False
) -> dict[str, tuple[int, ...]]:
    """LLAMA_STEPS steps of the model's own loss on seeded tokens (SGD with momentum, or
    AdamW); saves the whole state at step LLAMA_SAVED_AT (or starts from it), then the weights
    and the config as ``from_pretrained`` reads them. What this process holds of the split
    layers of the first block."""
    import transformers

    torch.manual_seed(0)
    config = _llama_config(tied)
    model = transformers.AutoModelForCausalLM.from_config(config)
    optimizer: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if adamw
        else torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    )
    model, optimizer = rt.setup(model, optimizer)
    state = Path(folder) / "state.pt"
    if resume:
        rt.load(state, {"model": model, "optimizer": optimizer})
    tokens = torch.randint(
        64, (LLAMA_STEPS * BATCH // 2, 16), generator=torch.Generator().manual_seed(0)
    )
    loader = rt.setup_loader(DataLoader(TensorDataset(tokens), batch_size=BATCH // 2))
    for step, (ids,) in enumerate(loader, start=1):
        if resume and step <= LLAMA_SAVED_AT:
            continue
        rt.backward(model(ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == LLAMA_SAVED_AT and not resume:
            rt.save(state, {"model": model, "optimizer": optimizer})
    out = Path(folder) / ("resumed" if resume else "end")
    rt.save_weights(model, out / "model.safetensors")
    if rt.is_main:
        config.save_pretrained(out)
    params = dict(model.named_parameters())
    split = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.down_proj",
    )
    held = [params[f"model.layers.0.{name}.weight"] for name in split]
    return {
        name: tuple(w.to_local().shape if is_sharded(w) else w.shape)
        for name, w in zip(split, held, strict=True)
    }


@pytest.mark.slow  # each process imports transformers: some 40 s
def test_llama_tp_2_trains_one_process_model_and_loads_with_from_pretrained(
    tmp_path: Path,
) -> None:
    """A Hugging Face Llama (tied head, grouped-query attention) split in 2 by its own plan
    (fsdp over one row) trains one process's model, and its weights load with
    ``from_pretrained`` under their plain names, the tie intact."""
    transformers = pytest.importorskip("transformers")

    one, tp = tmp_path / "one", tmp_path / "tp"
    paratrain.Runtime(strategy="cpu", seed=0).launch(_train_llama, str(one), True, False)
    rt = paratrain.Runtime(strategy="fsdp", devices="cpu,cpu", tp=2, seed=0)
    held = rt.launch(_train_llama, str(tp), True, False)
    # q: 4 heads of 8, k: 2 of 8, the MLP 64 wide: rows (colwise) or columns (rowwise) halved
    assert held == {
        "self_attn.q_proj": (16, 32),
        "self_attn.k_proj": (8, 32),
        "self_attn.o_proj": (32, 16),
        "mlp.gate_proj": (32, 32),
        "mlp.down_proj": (32, 32),
    }
    expected = load_file(str(one / "end" / "model.safetensors"))
    trained = load_file(str(tp / "end" / "model.safetensors"))
    difference = _diff(trained, expected)
    print(f"\nllama fsdp x tp 1x2 vs cpu after {LLAMA_STEPS} steps (SGD): {difference:.3g}")
    assert _diff(trained, expected) < TOLERANCE
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tp / "end")
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert _diff({k: v for k, v in loaded.state_dict().items() if k in trained}, trained) == 0


@pytest.mark.slow
def test_llama_fsdp_x_tp_2x2_trains_one_process_model_and_resumes_on_one(tmp_path: Path) -> None:
    """An untied Llama on a shard x tp mesh of 2 x 2 with AdamW reaches one process's weights;
    its step-4 checkpoint resumed on one process ends there too."""
    pytest.importorskip("transformers")
    one, tp = tmp_path / "one", tmp_path / "tp"
    paratrain.Runtime(strategy="cpu", seed=0).launch(_train_llama, str(one), False, True)
    rt = paratrain.Runtime(strategy="fsdp", devices="cpu,cpu,cpu,cpu", tp=2, seed=0)
    held = rt.launch(_train_llama, str(tp), False, True)
    # split in 2 by tp, then the rows in 2 by fsdp
    assert held == {
        "self_attn.q_proj": (8, 32),
        "self_attn.k_proj": (4, 32),
        "self_attn.o_proj": (16, 16),
        "mlp.gate_proj": (16, 32),
        "mlp.down_proj": (16, 32),
    }
    paratrain.Runtime(strategy="cpu", seed=0).launch(_train_llama, str(tp), False, True, True)
    expected = load_file(str(one / "end" / "model.safetensors"))
    trained = load_file(str(tp / "end" / "model.safetensors"))
    resumed = load_file(str(tp / "resumed" / "model.safetensors"))
    print(
        f"\nllama fsdp x tp 2x2 vs cpu after {LLAMA_STEPS} steps (AdamW): "
        f"{_diff(trained, expected):.3g}; saved at {LLAMA_SAVED_AT}, resumed on cpu: "
        f"{_diff(resumed, expected):.3g}"
    )
    assert _diff(trained, expected) < TOLERANCE
    assert _diff(resumed, expected) < TOLERANCE
