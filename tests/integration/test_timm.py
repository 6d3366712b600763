"""timm image models on every layout, as a user's loop trains them: a tiny ViT and a ResNet
(one block a layer), two gloo processes on the CPU (or two replicas in one, dp-balanced)
against one process, 20 SGD steps (the ResNet: 6). Under ddp, fsdp (the default blocks: the ViT's
``blocks.N``) and dp-balanced the ViT's weights end within 1e-5 of one process's; the ResNet
under ddp with ``sync_batchnorm`` (elsewhere each process normalizes its own part). Under
pipeline the ViT is cut at its blocks (patch embedding, class token and position embedding
with the first stage, the final norm and head with the last) and the ResNet between the
blocks of its layers; BatchNorm (the ResNet) is exact with one micro-batch per batch and
refused with more; the ``timm:`` recipe trains the same. ``paratrain plan --script`` on both:
a row per layout that trains them, the peak it predicts the peak measured."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.cli.commands.plan import task_builder
from paratrain.cli.main import main
from paratrain.strategies.blocks import default_blocks
from paratrain.tools.plan import trace_step

pytestmark = pytest.mark.slow  # real processes
timm = pytest.importorskip("timm")

TOLERANCE = 1e-5
#: SGD steps a run takes: the ResNet trained on noise is chaotic (a change of 1e-9 in its
#: weights moves the first step's BatchNorm gradients by 1e-2, and runs 20 steps long end
#: 0.1 to 1 apart), so it is compared after six
STEPS = {"vit": 20, "resnet": 6}


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "vit":
        return timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=16,
            patch_size=4, embed_dim=32, depth=4, num_heads=2,
        )  # fmt: skip
    from timm.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def _train(rt: paratrain.Runtime, family: str, path: str) -> torch.Tensor:
    model = _model(family)
    # SGD: Adam would turn the rounding noise in the gradient of the ViT's key bias (zero
    # in exact arithmetic: softmax ignores it) into steps of the learning rate's size
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # dp-balanced computes the loss on each device: it takes the loss function too
    model, optimizer, loss_fn = rt.setup(model, optimizer, nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(STEPS[family] * 8, 3, 16, 16, generator=generator)
    labels = torch.randint(10, (STEPS[family] * 8,), generator=generator)
    for x, y in rt.setup_loader(DataLoader(TensorDataset(images, labels), batch_size=8)):
        if rt.strategy.trains_in_pipeline:  # forward and backward together
            rt.forward_backward(model, loss_fn, x, y)
        else:
            rt.backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # evaluation: every process gets the whole batch's logits
        model.eval()
        outputs = model(images[:8])  # dp-balanced: a part on each device, gathered
        logits: torch.Tensor = outputs if isinstance(outputs, torch.Tensor) else outputs.gather()
    rt.save_weights(model, path)
    return logits


_ONE_PROCESS: dict[str, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}


def _one_process(family: str, folder: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if family not in _ONE_PROCESS:
        path = folder / f"{family}-cpu.safetensors"
        logits = paratrain.Runtime(strategy="cpu", seed=0).launch(_train, family, str(path))
        _ONE_PROCESS[family] = load_file(str(path)), logits
    return _ONE_PROCESS[family]


def _max_diff(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert weights.keys() == reference.keys()
    return max((weights[k].double() - reference[k].double()).abs().max().item() for k in weights)


def test_fsdp_default_blocks_of_timm_models_are_their_repeated_blocks() -> None:
    """The ViT's ``blocks.N`` (timm's ``Block``) and the ResNet's ``layer1..4``: the patch
    embedding, tokens, final norm and head (the stem and ``fc``) stay with the root."""

    def names(model: nn.Module) -> list[str]:
        by_id = {id(module): name for name, module in model.named_modules()}
        return [by_id[id(block)] for block in default_blocks(model)]

    assert names(_model("vit")) == [f"blocks.{i}" for i in range(4)]
    assert names(_model("resnet")) == ["layer1", "layer2", "layer3", "layer4"]


@pytest.mark.parametrize(
    ("family", "strategy"),
    [("vit", "ddp"), ("vit", "fsdp"), ("vit", "dp-balanced"), ("resnet", "ddp")],
)
def test_a_timm_model_trains_the_same_on_two_cpu_devices(
    family: str, strategy: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Weights (the ResNet's BatchNorm statistics and counts too, ``sync_batchnorm``) within
    1e-5 of one process's after 20 SGD steps (the ResNet: 6), and the logits of evaluation."""
    folder = tmp_path_factory.mktemp(f"{family}-{strategy}")
    reference, expected = _one_process(family, tmp_path_factory.getbasetemp())
    path = folder / "model.safetensors"
    rt = paratrain.Runtime(
        strategy=strategy, devices="cpu,cpu", seed=0, sync_batchnorm=family == "resnet"
    )
    logits = rt.launch(_train, family, str(path))
    diff = _max_diff(load_file(str(path)), reference)
    steps = STEPS[family]
    print(f"\ntimm {family} {strategy} --devices cpu,cpu vs cpu after {steps} steps: {diff:.3g}")
    assert diff < TOLERANCE
    assert (logits - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize(("family", "microbatches"), [("vit", 4), ("resnet", 1)])
def test_a_timm_model_trains_the_same_under_pipeline_on_two_cpu_devices(
    family: str, microbatches: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Weights (the ResNet's BatchNorm statistics and counts too) within 1e-5 of one
    process's after 20 SGD steps (the ResNet: 6); the logits of evaluation on rank 0, the
    first stage."""
    folder = tmp_path_factory.mktemp(f"{family}-pipeline")
    reference, expected = _one_process(family, tmp_path_factory.getbasetemp())
    path = folder / "model.safetensors"
    rt = paratrain.Runtime(
        strategy="pipeline", devices="cpu,cpu", seed=0, pipeline_microbatches=microbatches
    )
    logits = rt.launch(_train, family, str(path))
    weights = load_file(str(path))
    diff = _max_diff(weights, reference)
    print(
        f"\ntimm {family} pipeline --devices cpu,cpu vs cpu after {STEPS[family]} steps: {diff:.3g}"
    )
    assert diff < TOLERANCE
    assert (logits - expected).abs().max().item() < TOLERANCE
    if family == "resnet":  # each BatchNorm counted the batches, not the micro-batches
        assert weights["bn1.num_batches_tracked"].item() == STEPS[family]


def test_pipeline_refuses_batchnorm_over_micro_batches_with_the_reason(
    tmp_path: Path, paratrain_here: Any
) -> None:
    """`--recipe timm:resnet18 --strategy pipeline`: four micro-batches a batch would
    normalize each with its own statistics; refused in one line before any process starts,
    naming --pipeline-microbatches 1."""
    done = paratrain_here(
        "train", "--recipe", "timm:resnet18", "--strategy", "pipeline", "--devices", "cpu,cpu",
        "--max-steps", "1", "--out", "refused",
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "ResNet has BatchNorm (20 layers)" in done.stderr
    assert "Use --pipeline-microbatches 1 (exact" in done.stderr
    assert not (tmp_path / "refused").exists()


def test_the_timm_recipe_trains_the_same_under_pipeline(
    tmp_path: Path, paratrain_here: Any
) -> None:
    """`paratrain train --recipe timm:vit_tiny_patch16_224 --strategy pipeline --devices
    cpu,cpu --pipeline-microbatches 1`: within 1e-5 of one process after 4 steps. One
    micro-batch and one thread a process: the recipe's AdamW turns any change of rounding
    in a gradient that is zero in exact arithmetic (the attention's key bias) into a step of
    the learning rate's size."""
    common = ("train", "--recipe", "timm:vit_tiny_patch16_224", "--max-steps", "4")
    common += ("--threads", "1")
    weights = {}
    runs = (("cpu", "cpu"), ("pipeline", "cpu,cpu", "--pipeline-microbatches", "1"))
    for strategy, devices, *options in runs:
        done = paratrain_here(
            *common, "--strategy", strategy, "--devices", devices, *options,
            "--batch-size", "8", "--no-progress", "--out", strategy,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        weights[strategy] = load_file(str(tmp_path / strategy / "model.safetensors"))
    one, two = weights["cpu"], weights["pipeline"]
    assert one.keys() == two.keys() and "cls_token" in one
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    print(f"\ntimm:vit_tiny_patch16_224 pipeline vs cpu after 4 steps: max abs diff {diff:.3g}")
    assert diff < TOLERANCE


_FACTORIES = {
    "vit": """
import timm
import torch
from torch import nn


def build():
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32,
        patch_size=4, embed_dim=64, depth=4, num_heads=2,
    )

    def sample(n):
        return torch.randn(n, 3, 32, 32), torch.randint(10, (n,))

    return model, nn.CrossEntropyLoss(), sample
""",
    "resnet": """
import torch
from timm.models.resnet import BasicBlock, ResNet
from torch import nn


def build():
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)

    def sample(n):
        return torch.randn(n, 3, 32, 32), torch.randint(10, (n,))

    return model, nn.CrossEntropyLoss(), sample
""",
}


@pytest.mark.parametrize(
    ("family", "rows"),
    [("vit", ["cpu", "ddp", "fsdp", "pipeline"]), ("resnet", ["cpu", "ddp", "fsdp"])],
)
def test_plan_of_a_timm_model_has_a_row_per_layout_that_trains_it(
    family: str, rows: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`paratrain plan --script` on a timm ViT (its constructor reads a number it computes,
    which fake tensors cannot give: built on real ones) and a ResNet: a row for each layout
    that trains it, none for pipeline on the ResNet (BatchNorm over micro-batches), the
    reason in ``refused``; the peak predicted on fake tensors within 15% of the peak the same
    tracker measures over real tensors."""
    script = tmp_path / f"{family}.py"
    script.write_text(_FACTORIES[family])
    argv = ["plan", "--script", f"{script}:build", "--batch-size", "8", "--accelerator", "cpu"]
    assert main([*argv, "--devices", "2", "--json"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert [row["layout"] for row in plan["layouts"]] == rows
    if family == "resnet":
        assert "BatchNorm" in plan["refused"]["pipeline"]
    else:
        assert "pipeline" not in plan["refused"]
    build, _ = task_builder(SimpleNamespace(script=f"{script}:build"))
    predicted, measured = trace_step(build, 8).peak, trace_step(build, 8, fake=False).peak
    print(f"\nplan {family} @8: predicted {predicted.total}, measured {measured.total} bytes")
    assert measured.parameters > 0 and measured.activations > 0
    assert abs(predicted.total / measured.total - 1) <= 0.15
