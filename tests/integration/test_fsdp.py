"""fsdp: FSDP2 over real gloo processes on the CPU.

The weights after 50 digits steps match one process (tests/test_equivalence.py); here:
which blocks are sharded, what each process holds, full-weight checkpoints that load into
any layout, exact resume, and bad input refused before any process starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CLI, assert_stopped_and_resumed_run_is_bit_identical
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.cli.main import main
from paratrain.distributed.dtensors import local_bytes
from paratrain.models import GPT, DigitsCNN, TransformerBlock, resnet18
from paratrain.strategies.blocks import choose_blocks
from paratrain.tools.bench.combos import enumerate_combos
from paratrain.tools.bench.recommend import Candidate, recommend
from paratrain.training import recipes
from paratrain.training.config import TrainConfig
from paratrain.utils.errors import UserError

WIDTH, DEPTH = 64, 4


pytestmark = pytest.mark.slow  # real processes, or several layers at work


def test_default_blocks_are_the_repeated_layers() -> None:
    gpt = GPT(width=32, depth=3)
    assert {id(b) for b in choose_blocks(gpt)} == {id(b) for b in gpt.blocks}
    digits = DigitsCNN()
    assert {id(b) for b in choose_blocks(digits)} == {id(digits.features), id(digits.classifier)}
    resnet = resnet18(num_classes=10)
    layers = [resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4]
    assert {id(b) for b in choose_blocks(resnet)} == {id(layer) for layer in layers}
    assert choose_blocks(nn.Linear(3, 2)) == []  # one unit: the root


def test_named_blocks_by_class_or_module_name() -> None:
    gpt = GPT(width=32, depth=2)
    assert {id(b) for b in choose_blocks(gpt, ["TransformerBlock"])} == {id(b) for b in gpt.blocks}
    # nested blocks come before the block holding them
    chosen = choose_blocks(gpt, ["blocks.0", "blocks.0.mlp"])
    assert chosen == [gpt.blocks[0].mlp, gpt.blocks[0]]
    with pytest.raises(UserError, match="--fsdp-blocks Nope: no module of GPT"):
        choose_blocks(gpt, ["TransformerBlock", "Nope"])


def test_model_without_parameters_is_refused_before_any_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    empty = recipes.Recipe(
        name="empty",
        description="test only",
        epochs=1,
        batch_size=4,
        lr=0.1,
        build_model=lambda cfg: nn.Sequential(nn.ReLU()),
        build_data=lambda cfg: (torch.zeros(4), torch.zeros(4)),  # type: ignore[arg-type,return-value]
        build_optimizer=lambda params, cfg: torch.optim.SGD(params, lr=0.1),
        build_loss=nn.MSELoss,
    )
    monkeypatch.setitem(recipes._RECIPES, "empty", empty)
    cfg = TrainConfig(recipe="empty", strategy="fsdp", devices="cpu,cpu")
    with pytest.raises(UserError, match="shards parameters, and Sequential has none"):
        cfg.resolved(recipes.get_recipe)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--fsdp-blocks", "Nope"), "--fsdp-blocks Nope: no module of DigitsCNN"),
        (("--devices", "cpu,meta"), "--strategy fsdp needs CUDA devices or CPU processes"),
        (("--devices", "cpu,cpu", "--batch-size", "1"), "--batch-size 1 is smaller"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, options: tuple[str, ...], message: str
) -> None:
    # in this process: refused before any process starts (a real process: test_cli)
    out = tmp_path / "bad"
    args = ["train", "--strategy", "fsdp", "--devices", "cpu,cpu", "--no-progress", *options]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(width=WIDTH, depth=DEPTH)


def _fsdp_in_each_process(rt: paratrain.Runtime, folder: str) -> list[float]:
    plain = _gpt()
    model = _gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    tokens = torch.randint(64, (4, 32), generator=torch.Generator().manual_seed(rt.rank))
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    rt.backward(loss)
    optimizer.step()  # momentum buffers now exist
    params = list(model.parameters())
    held = sum(local_bytes(p) for p in params)  # parameters
    held += sum(local_bytes(p.grad) for p in params if p.grad is not None)  # gradients
    held += sum(local_bytes(s["momentum_buffer"]) for s in optimizer.state.values())
    blocks = sum(isinstance(m, TransformerBlock) and hasattr(m, "unshard") for m in model.modules())

    # rt.save holds full tensors; rt.load into a fresh sharded model restores them exactly
    path = Path(folder) / "state.pt"
    rt.save(path, {"model": model, "optimizer": optimizer})
    fresh = _gpt()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh, fresh_opt = rt.setup(fresh, fresh_opt)
    rt.load(path, {"model": fresh, "optimizer": fresh_opt})
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    same_momentum = all(
        torch.equal(
            optimizer.state[a]["momentum_buffer"].to_local(),
            fresh_opt.state[b]["momentum_buffer"].to_local(),
        )
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    # load_weights: plain full weights into a sharded model
    paratrain.load_weights(fresh, plain.state_dict())
    gathered = Path(folder) / "plain.safetensors"
    rt.save_weights(fresh, gathered)
    reloaded = load_file(str(gathered))
    exact = all(torch.equal(reloaded[k], v) for k, v in plain.state_dict().items())
    # built on the meta device: each process materialises one block at a time and keeps
    # its shards; the test compares the gathered weights with a one-process build
    with torch.device("meta"):
        meta = GPT(width=WIDTH, depth=DEPTH)
    rt.save_weights(rt.setup(meta), Path(folder) / "meta.safetensors")
    return [float(held), float(blocks), float(same), float(same_momentum), float(exact)]


def test_each_process_holds_its_share_and_checkpoints_are_full(tmp_path: Path) -> None:
    rt = paratrain.Runtime(strategy="fsdp", devices="cpu,cpu", seed=0)
    result = rt.launch(_fsdp_in_each_process, str(tmp_path))
    assert result is not None
    held, blocks, same, same_momentum, exact = result
    # the meta-built model's weights are those --strategy cpu gives the same seed, exactly
    with torch.device("meta"):
        one = GPT(width=WIDTH, depth=DEPTH)
    one = paratrain.Runtime("cpu", seed=0).setup(one)
    built = load_file(str(tmp_path / "meta.safetensors"))
    assert built.keys() == one.state_dict().keys()
    assert all(torch.equal(built[k], v) for k, v in one.state_dict().items())
    model = _gpt()
    total = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # + grads + momentum
    print(f"\nfsdp 2 processes: rank 0 holds {held:,.0f} of {total:,} bytes")
    assert abs(held - total / 2) < 0.02 * total  # about M/N (shards are padded to equal rows)
    assert blocks == DEPTH  # each TransformerBlock sharded as a unit
    assert same == same_momentum == exact == 1.0
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    assert saved["model"].keys() == model.state_dict().keys()
    assert saved["model"]["head.weight"].shape == (64, WIDTH)  # full tensors, not shards
    momenta = [saved["optimizer"]["state"][i]["momentum_buffer"] for i in range(3)]
    assert [m.shape for m in momenta] == [p.shape for p in list(model.parameters())[:3]]


def test_fsdp_run_stopped_and_resumed_is_bit_identical(
    paratrain_cli: CLI, paratrain_here: CLI, tmp_path: Path
) -> None:
    assert_stopped_and_resumed_run_is_bit_identical(paratrain_cli, paratrain_here, tmp_path, "fsdp")


def test_bench_measures_fsdp_and_says_when_it_is_the_only_fit() -> None:
    # on CPU processes fsdp is measured when named (the default set leaves it out)
    default = enumerate_combos(None, ["32"], [8], "cpu,cpu")
    assert [c.processes for c in default if c.strategy == "fsdp" and not c.skip_reason] == []
    combos = enumerate_combos(["fsdp"], ["32"], [8], "cpu,cpu")
    fsdp = [c for c in combos if c.strategy == "fsdp"]
    assert [(c.processes, c.skip_reason) for c in fsdp] == [(2, None)]
    ran = Candidate("fsdpx2 32 b64", "ok", [100.0, 101.0, 102.0])
    message = recommend([Candidate("cuda 32 b64", "oom"), ran]).message
    assert "the only layout that fits in memory (cuda 32 b64: out of memory)" in message
    assert "only combination that ran" in recommend([ran]).message


# -- a model shaped like Hugging Face's GPT-2: a word embedding tied to the head ------------
class _HFBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class _HFTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(64, WIDTH), nn.Embedding(32, WIDTH)
        self.h = nn.ModuleList([_HFBlock() for _ in range(DEPTH)])
        self.ln_f = nn.LayerNorm(WIDTH)


class _HFLMHead(nn.Module):
    """GPT2LMHeadModel's layout: ``transformer.{wte,wpe,h,ln_f}`` and ``lm_head``, whose
    weight is ``wte``'s."""

    _no_split_modules = ("_HFBlock",)  # what Hugging Face models declare (GPT2Block...)

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _HFTransformer()
        self.lm_head = nn.Linear(WIDTH, 64, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inner = self.transformer
        x = inner.wte(tokens) + inner.wpe(torch.arange(tokens.shape[1]))
        for block in inner.h:
            x = block(x)
        return self.lm_head(inner.ln_f(x))


def _train_tied(rt: paratrain.Runtime, path: str) -> None:
    torch.manual_seed(0)
    model = _HFLMHead()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tokens = torch.randint(64, (32, 16), generator=torch.Generator().manual_seed(0))
    for (batch,) in rt.setup_loader(DataLoader(TensorDataset(tokens), batch_size=8)):
        logits = model(batch)
        rt.backward(nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten()))
        optimizer.step()
        optimizer.zero_grad()
    rt.save_weights(model, path)


def test_a_tied_word_embedding_stays_with_the_root_and_fsdp_trains_the_same_model(
    tmp_path: Path,
) -> None:
    """--strategy fsdp --devices cpu,cpu (gloo): the default blocks are the classes the
    model declares (``_no_split_modules``); without them, the repeated layers, leaving
    GPT-2's tied ``wte``/``lm_head`` to the root (FSDP refuses a parameter in two units).
    Four steps give one process's weights, the tie kept; naming the embedding as a block is
    one line."""
    model = _HFLMHead()

    def chosen() -> set[str]:
        blocks = choose_blocks(model)
        return {name for name, m in model.named_modules() if any(m is b for b in blocks)}

    layers = {f"transformer.h.{i}" for i in range(DEPTH)}
    assert chosen() == layers
    model._no_split_modules = ()  # type: ignore[assignment]
    assert chosen() == {"transformer.wpe", *layers}
    with pytest.raises(UserError, match=r"transformer.wte \(Embedding\) shares a parameter"):
        choose_blocks(model, ["transformer.wte"])
    paratrain.Runtime(strategy="cpu", seed=0).launch(_train_tied, str(tmp_path / "one.st"))
    rt = paratrain.Runtime(strategy="fsdp", devices="cpu,cpu", seed=0)
    rt.launch(_train_tied, str(tmp_path / "fsdp.st"))
    one, two = load_file(str(tmp_path / "one.st")), load_file(str(tmp_path / "fsdp.st"))
    assert one.keys() == two.keys()
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-6
