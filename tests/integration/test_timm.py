"""timm image models under pipeline, as a user's loop trains them: a tiny ViT cut at its
blocks (patch embedding, class token and position embedding with the first stage, the final
norm and head with the last) and a ResNet cut between the blocks of its layers, two gloo
processes on the CPU against one process. BatchNorm (the ResNet) is exact with one
micro-batch per batch and refused with more; the ``timm:`` recipe trains the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import paratrain

pytestmark = pytest.mark.slow  # real processes
timm = pytest.importorskip("timm")

TOLERANCE = 1e-5
STEPS = 6


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
    model, optimizer = rt.setup(model, optimizer)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(STEPS, 8, 3, 16, 16, generator=generator)
    labels = torch.randint(10, (STEPS, 8), generator=generator)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in zip(images, labels, strict=True):
        if rt.strategy.trains_in_pipeline:  # forward and backward together
            rt.forward_backward(model, loss_fn, x, y)
        else:
            rt.backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # evaluation: every process gets the last stage's logits
        model.eval()
        logits: torch.Tensor = model(images[0])
    rt.save_weights(model, path)
    return logits


@pytest.mark.parametrize(("family", "microbatches"), [("vit", 4), ("resnet", 1)])
def test_a_timm_model_trains_the_same_under_pipeline_on_two_cpu_devices(
    family: str, microbatches: int, tmp_path: Path
) -> None:
    """Weights (the ResNet's BatchNorm statistics and counts too) within 1e-5 of one
    process's after six SGD steps; the logits of evaluation on rank 0, the first stage."""
    one = tmp_path / "cpu.safetensors"
    expected = paratrain.Runtime(strategy="cpu", seed=0).launch(_train, family, str(one))
    two = tmp_path / "pipeline.safetensors"
    rt = paratrain.Runtime(
        strategy="pipeline", devices="cpu,cpu", seed=0, pipeline_microbatches=microbatches
    )
    logits = rt.launch(_train, family, str(two))
    reference, weights = load_file(str(one)), load_file(str(two))
    assert weights.keys() == reference.keys()
    diff = max((weights[k].double() - reference[k].double()).abs().max().item() for k in weights)
    print(f"\ntimm {family} pipeline --devices cpu,cpu vs cpu after {STEPS} steps: {diff:.3g}")
    assert diff < TOLERANCE
    assert (logits - expected).abs().max().item() < TOLERANCE
    if family == "resnet":  # each BatchNorm counted the six batches, not the micro-batches
        assert weights["bn1.num_batches_tracked"].item() == STEPS


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
