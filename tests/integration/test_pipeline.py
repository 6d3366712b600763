"""pipeline: the model's layers split into stages over real gloo processes on the CPU.

The weights after 50 digits steps match one process (tests/test_equivalence.py); here:
where models are cut, what each process holds, full-weight checkpoints that load into any
layout, evaluation on every process, exact resume, and bad input refused before any
process starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CLI, assert_stopped_and_resumed_run_is_bit_identical
from safetensors.torch import load_file
from torch import nn

import paratrain
from paratrain.cli.main import main
from paratrain.models import GPT, DigitsCNN
from paratrain.strategies.pipeline_plan import plan_stages
from paratrain.tools.bench.combos import enumerate_combos
from paratrain.utils.errors import UserError

pytestmark = pytest.mark.slow  # real processes, or several layers at work


def _keys(stages: list[nn.Module]) -> list[list[str]]:
    return [sorted({key.rsplit(".", 1)[0] for key in stage.state_dict()}) for stage in stages]


def _chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    value: object = x
    for stage in stages:
        value = stage(*value) if isinstance(value, tuple) else stage(value)
    assert isinstance(value, torch.Tensor)
    return value


def test_default_split_balances_the_layers_and_keeps_the_names() -> None:
    digits = DigitsCNN()
    two = plan_stages(digits, 2)
    assert _keys(two) == [["features.0", "features.2"], ["classifier.1", "classifier.3"]]
    # three stages open the Sequential holding the most parameters
    three = plan_stages(digits, 3)
    assert _keys(three)[1:] == [["classifier.1"], ["classifier.3"]]
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(_chain(three, x), digits(x))
    gpt = GPT(width=32, depth=4)
    stages = plan_stages(gpt, 2)
    assert "position" in stages[0].state_dict() and "head.weight" in stages[1].state_dict()
    assert {k.split(".")[1] for k in stages[1].state_dict() if k.startswith("blocks.")} == {
        "2",
        "3",
    }
    tokens = torch.randint(64, (3, 16))
    assert torch.equal(_chain(stages, tokens), gpt(tokens))
    # the stages hold the model's own parameters: nothing is copied
    mine = {id(p) for p in gpt.parameters()}
    assert all(id(p) in mine for stage in stages for p in stage.parameters())


def test_named_split_points_may_cut_inside_a_block() -> None:
    gpt = GPT(width=32, depth=2)
    stages = plan_stages(gpt, 3, ["blocks.1", "norm"])
    assert _keys(stages)[2] == ["head", "norm"]
    inside = plan_stages(gpt, 2, ["blocks.1.mlp"])
    tokens = torch.randint(64, (2, 8))
    assert torch.equal(_chain(inside, tokens), gpt(tokens))  # the residual travels along
    with pytest.raises(UserError, match=r"blocks\.1\.mlp lies inside blocks\.1"):
        plan_stages(gpt, 3, ["blocks.1", "blocks.1.mlp"])


@pytest.mark.parametrize(
    ("model", "stages", "names", "message"),
    [
        (DigitsCNN(), 5, (), "with 5 stages needs at least 5 layers to split between, and"),
        (nn.Sequential(nn.ReLU()), 2, (), "splits layers, and Sequential has none"),
        (GPT(depth=2), 2, ("blocks.7",), "--pipeline-split blocks.7: GPT has no such submodule"),
        (GPT(depth=2), 3, ("blocks.1",), "which make 2 stages, but the run has 3 processes"),
        (GPT(depth=4), 3, ("blocks.2", "blocks.1"), "runs them in the order blocks.1,blocks.2"),
        (GPT(depth=2, tie=True), 2, (), "shares a parameter between stages 1 and 2"),
    ],
)
def test_models_that_cannot_be_cut_are_refused(
    model: nn.Module, stages: int, names: tuple[str, ...], message: str
) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        plan_stages(model, stages, names)


class _Skip(nn.Module):
    """Its output needs its input: no cut between a and b passes it along."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + x


def test_a_value_skipping_a_stage_is_refused() -> None:
    with pytest.raises(UserError, match="stage 2 of _Skip needs a value from the model's inputs"):
        plan_stages(_Skip(), 2, ["b"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--devices", "cpu,cpu,cpu,cpu,cpu"), "with 5 stages needs at least 5 layers"),
        (("--devices", "cpu"), "--strategy pipeline needs at least 2 processes"),
        (("--devices", "cpu,cpu,cpu", "--pipeline-split", "classifier"), "make 2 stages"),
        (("--devices", "cpu,cpu", "--precision", "fp16"), "needs a GradScaler shared"),
        (("--devices", "cpu,cpu", "--compile"), "--compile does not work with --strategy pipeline"),
        (
            ("--devices", "cpu,cpu", "--recipe", "cifar10-resnet18", "--synthetic", "64"),
            "ResNet has BatchNorm (20 layers), which would normalize each with its own",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, options: tuple[str, ...], message: str
) -> None:
    # in this process: refused before any process starts (a real process: test_cli)
    out = tmp_path / "bad"
    argv = ["train", "--strategy", "pipeline", "--no-progress", "--out", str(out), *options]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(width=32, depth=4)


def _pipeline_in_each_process(rt: paratrain.Runtime, folder: str) -> list[float]:
    plain, model = _gpt(), _gpt()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    tokens = torch.randint(64, (6, 16), generator=torch.Generator().manual_seed(0))
    loss_fn = paratrain.models.TokenCrossEntropy()
    loss = rt.forward_backward(model, loss_fn, tokens, tokens)
    optimizer.step()  # momentum buffers now exist, for this stage's parameters only
    expected = loss_fn(plain(tokens), tokens)
    expected.backward()
    plain_opt.step()
    after = plain.state_dict()
    stepped = max((v - after[k]).abs().max().item() for k, v in model.state_dict().items())
    held = len(optimizer.state)
    try:
        rt.backward(loss)
        refused = 0.0
    except UserError:
        refused = 1.0
    with torch.no_grad():  # evaluation: every process gets the last stage's output
        model.eval()
        plain.eval()
        output_diff = (model(tokens) - plain(tokens)).abs().max().item()
    # rt.save holds full tensors; rt.load into a fresh pipeline restores them exactly
    path = Path(folder) / "state.pt"
    rt.save(path, {"model": model, "optimizer": optimizer})
    fresh = _gpt()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh, fresh_opt = rt.setup(fresh, fresh_opt)
    rt.load(path, {"model": fresh, "optimizer": fresh_opt})
    same = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    same_momentum = all(
        torch.equal(optimizer.state[a]["momentum_buffer"], fresh_opt.state[b]["momentum_buffer"])
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    # load_weights: plain full weights into a stage; save_weights gathers every stage's
    paratrain.load_weights(fresh, _gpt().state_dict())
    gathered = Path(folder) / "plain.safetensors"
    rt.save_weights(fresh, gathered)
    reloaded = load_file(str(gathered))
    exact = all(torch.equal(reloaded[k], v) for k, v in _gpt().state_dict().items())
    loss_diff = abs(loss.item() - expected.item())
    restored = float(same and same_momentum and exact)
    # built on the meta device: each process materialises its own stage only
    with torch.device("meta"):
        meta = GPT(width=32, depth=4)
    stage = rt.setup(meta)
    real = sum(not p.is_meta for p in meta.parameters())  # of the whole model's 53
    rt.save_weights(stage, Path(folder) / "meta.safetensors")
    return [loss_diff, stepped, float(held), refused, output_diff, restored, float(real)]


def test_each_process_trains_its_stage_and_checkpoints_are_full(tmp_path: Path) -> None:
    rt = paratrain.Runtime(
        strategy="pipeline", devices="cpu,cpu", pipeline_split=["blocks.2"], seed=0
    )
    result = rt.launch(_pipeline_in_each_process, str(tmp_path))
    assert result is not None
    loss_diff, stepped, held, refused, output_diff, restored, real = result
    assert real == 26  # rank 0 materialised its stage's parameters only, not rank 1's
    # the meta-built model's weights are those --strategy cpu gives the same seed, exactly
    with torch.device("meta"):
        one = GPT(width=32, depth=4)
    one = paratrain.Runtime("cpu", seed=0).setup(one)
    built = load_file(str(tmp_path / "meta.safetensors"))
    assert built.keys() == one.state_dict().keys()
    assert all(torch.equal(built[k], v) for k, v in one.state_dict().items())
    print(f"\npipeline 2 processes: loss diff {loss_diff:.3g}, weights after a step {stepped:.3g}")
    assert loss_diff < 1e-5 and stepped < 1e-6 and output_diff < 1e-5
    assert held == 26  # rank 0's stage: embedding, positions and two blocks of 12 tensors
    assert refused == 1.0 and restored == 1.0
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    assert saved["model"].keys() == _gpt().state_dict().keys()
    # the optimizer file numbers every parameter, as one process's does
    assert sorted(saved["optimizer"]["state"]) == list(range(len(list(_gpt().parameters()))))


def test_pipeline_run_stopped_and_resumed_is_bit_identical(
    paratrain_cli: CLI, paratrain_here: CLI, tmp_path: Path
) -> None:
    assert_stopped_and_resumed_run_is_bit_identical(
        paratrain_cli, paratrain_here, tmp_path, "pipeline"
    )


def test_bench_measures_pipeline_and_says_why_not_fp16() -> None:
    combos = enumerate_combos(["pipeline"], ["32", "fp16"], [8], "cpu,cpu")
    assert [(c.precision, c.processes) for c in combos] == [("32", 2), ("fp16", 2)]
    assert combos[0].skip_reason is None
    assert "needs a GradScaler shared by the stages" in str(combos[1].skip_reason)


def _batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(),
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3),
    )  # fmt: skip


def _train_batchnorm(rt: paratrain.Runtime, path: str) -> None:
    model = _batchnorm_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(16, 4, generator=generator), torch.randint(3, (16,), generator=generator)
        rt.forward_backward(model, nn.CrossEntropyLoss(), x, y)
        optimizer.step()
        optimizer.zero_grad()
    rt.save_weights(model, path)


def test_batchnorm_statistics_and_counts_match_one_process(tmp_path: Path) -> None:
    """A stage's first step runs it once more to learn its shapes (torch before 2.14, in
    training mode): BatchNorm's running statistics and ``num_batches_tracked`` count only
    the batches trained on, as on one process."""
    paratrain.Runtime(strategy="cpu").launch(_train_batchnorm, str(tmp_path / "one.safetensors"))
    rt = paratrain.Runtime(
        strategy="pipeline", devices="cpu,cpu", pipeline_microbatches=1, pipeline_split=["3"]
    )
    rt.launch(_train_batchnorm, str(tmp_path / "pipeline.safetensors"))
    one = load_file(str(tmp_path / "one.safetensors"))
    piped = load_file(str(tmp_path / "pipeline.safetensors"))
    assert one.keys() == piped.keys()
    assert [int(piped[f"{i}.num_batches_tracked"]) for i in (1, 4)] == [3, 3]
    for key in one:
        assert torch.allclose(one[key].double(), piped[key].double(), atol=1e-6), key
