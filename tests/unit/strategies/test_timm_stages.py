"""A timm ViT's or ResNet's pipeline stages built from its block list (no processes): the
stages hold the model's own modules and parameters under its names, chained they compute
the model's logits, and a cut they cannot make is one line. Stand-ins with timm's layout
(the same names and the same forward) test the building without timm; timm's own models,
where timm is installed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from paratrain.strategies import timm_stages
from paratrain.strategies.block_cut import block_starts
from paratrain.strategies.pipeline_plan import plan_stages
from paratrain.utils.errors import UserError


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _Flat(nn.Conv2d):
    """A patch embedding giving tokens, as timm's PatchEmbed does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).flatten(2).transpose(1, 2)


class StandInViT(nn.Module):
    """timm's VisionTransformer, cut down: the same names, the same forward."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.num_prefix_tokens, self.global_pool = 1, "token"
        self.patch_embed = _Flat(3, width, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, width))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, width))
        self.pos_drop, self.patch_drop = nn.Dropout(0.0), nn.Identity()
        self.norm_pre = nn.Identity()
        self.blocks = nn.Sequential(*(_Block(width) for _ in range(depth)))
        self.norm, self.fc_norm = nn.LayerNorm(width), nn.Identity()
        self.head_drop, self.head = nn.Dropout(0.0), nn.Linear(width, 10)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + self.pos_embed)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0] if self.global_pool == "token" else x[:, self.num_prefix_tokens :].mean(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = self.norm_pre(self.patch_drop(self._pos_embed(x)))
        x = self.norm(self.blocks(x))
        return self.head(self.head_drop(self.fc_norm(self.pool(x))))


class StandInResNet(nn.Module):
    """timm's ResNet, cut down: stem, layer1..4 of blocks, global pool and fc."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.drop_rate = 0.0
        self.conv1, self.bn1 = nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width)
        self.act1, self.maxpool = nn.ReLU(), nn.MaxPool2d(2)
        for index, depth in enumerate((2, 1, 2, 1), start=1):
            convs = (nn.Conv2d(width, width, 3, padding=1) for _ in range(depth))
            setattr(self, f"layer{index}", nn.Sequential(*convs))
        self.global_pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.global_pool(x))


def _chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for stage in stages:
            x = stage(x)
    return x


def _check(model: nn.Module, stages: list[nn.Module], x: torch.Tensor) -> None:
    keys = [list(stage.state_dict()) for stage in stages]
    assert sorted(k for part in keys for k in part) == sorted(model.state_dict())
    mine = {id(p) for p in model.parameters()}  # the model's own: nothing copied
    assert all(id(p) in mine for stage in stages for p in stage.parameters())
    with torch.no_grad():
        expected = model(x)
    assert torch.equal(_chain(stages, x), expected)


def test_a_stand_in_vit_cut_at_its_blocks_computes_its_logits() -> None:
    torch.manual_seed(0)
    model = StandInViT().eval()
    assert timm_stages.image_layout(model) is None  # not timm's class: never taken for it
    blocks = timm_stages.block_names(model, timm_stages.VIT)
    assert blocks == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    stages = timm_stages.build_stages(model, timm_stages.VIT, [1, 3])
    assert [s.block_names for s in stages] == [["blocks.0"], ["blocks.1", "blocks.2"], ["blocks.3"]]
    first = dict(stages[0].named_parameters(recurse=False))
    assert sorted(first) == ["cls_token", "pos_embed"]  # the model's own, first stage only
    assert not list(stages[1].named_parameters(recurse=False))
    _check(model, stages, torch.randn(3, 3, 8, 8))
    model.global_pool = "avg"  # the pooling helper reads the stage's copy of the setting
    pooled = timm_stages.build_stages(model, timm_stages.VIT, [2])
    _check(model, pooled, torch.randn(2, 3, 8, 8))


def test_a_stand_in_resnet_is_cut_between_the_blocks_of_its_layers() -> None:
    torch.manual_seed(0)
    model = StandInResNet().eval()
    blocks = timm_stages.block_names(model, timm_stages.RESNET)
    assert blocks == ["layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer3.1", "layer4.0"]
    weights = timm_stages.segment_weights(model, timm_stages.RESNET)
    assert sum(weights) == sum(p.numel() for p in model.parameters())
    aliases = timm_stages.aliases(timm_stages.RESNET, blocks)
    starts = block_starts("ResNet", blocks, weights, 2, ["layer3"], aliases)
    assert starts == [3]  # layer3 starts with its first block
    stages = timm_stages.build_stages(model, timm_stages.RESNET, starts)
    assert "conv1.weight" in stages[0].state_dict() and "fc.weight" in stages[1].state_dict()
    assert "bn1.running_mean" in stages[0].state_dict()  # buffers travel with their module
    _check(model, stages, torch.randn(2, 3, 8, 8))
    balanced = block_starts("ResNet", blocks, weights, 3, [])
    three = timm_stages.build_stages(model, timm_stages.RESNET, balanced)
    _check(model, three, torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize(
    ("stages", "split", "says"),
    [
        (7, (), "needs at least 7 blocks to split between, and ResNet has 6"),
        (2, ("fc",), "ResNet is cut between its blocks; name blocks that start stages 2, 3"),
        (3, ("layer3.0", "layer2"), "in the order the model runs them"),
        (2, ("layer1",), "name blocks after the first"),
    ],
)
def test_a_cut_the_block_list_cannot_take_is_one_line(
    stages: int, split: tuple[str, ...], says: str
) -> None:
    model = StandInResNet()
    blocks = timm_stages.block_names(model, timm_stages.RESNET)
    weights = timm_stages.segment_weights(model, timm_stages.RESNET)
    aliases = timm_stages.aliases(timm_stages.RESNET, blocks)
    with pytest.raises(UserError, match=says):
        block_starts("ResNet", blocks, weights, stages, split, aliases)


def _timm() -> Any:
    return pytest.importorskip("timm")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"global_pool": "avg", "class_token": False, "reg_tokens": 2, "no_embed_class": True},
        {"global_pool": "map"},
    ],
)
def test_timm_vits_are_cut_at_their_blocks_and_chained_give_their_logits(
    options: dict[str, Any],
) -> None:
    timm = _timm()
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=16, patch_size=4,
        embed_dim=32, depth=4, num_heads=2, **options,
    ).eval()  # fmt: skip
    stages = plan_stages(model, 3)
    assert [len(s.block_names) for s in stages] == [1, 2, 1]  # the stem and head weigh
    _check(model, stages, torch.randn(2, 3, 16, 16))
    named = plan_stages(model, 2, ["blocks.1"])
    assert named[1].block_names == ["blocks.1", "blocks.2", "blocks.3"]


@pytest.mark.parametrize("deep", [False, True])
def test_timm_resnets_are_cut_between_their_blocks(deep: bool) -> None:
    """ResNet-18's layout with one block a layer, and ResNet-50-D's (a deep stem, average
    pooling on the shortcut), small."""
    _timm()
    from timm.models.resnet import BasicBlock, Bottleneck, ResNet

    torch.manual_seed(0)
    if deep:
        model = ResNet(Bottleneck, [1, 1, 2, 1], stem_type="deep", avg_down=True, stem_width=8)
    else:
        model = ResNet(BasicBlock, [1, 1, 2, 1], num_classes=10)
    model.eval()
    stages = plan_stages(model, 2, ["layer3"])
    assert stages[1].block_names[0] == "layer3.0"
    _check(model, stages, torch.randn(2, 3, 32, 32))
    _check(model, plan_stages(model, 3), torch.randn(2, 3, 32, 32))
    with pytest.raises(UserError, match="has no such submodule"):
        plan_stages(model, 2, ["layer9"])
