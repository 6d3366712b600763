"""Tests for the bundled models: torchvision-compatible ResNet-18 and the digits CNN."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from paratrain.models import DigitsCNN, resnet18

# torchvision.models.resnet18(num_classes=10).state_dict(), key by key, in order.
# Written out literally so the test needs no torchvision.
TORCHVISION_RESNET18_KEYS: list[tuple[str, tuple[int, ...]]] = [
    ("conv1.weight", (64, 3, 7, 7)),
    ("bn1.weight", (64,)),
    ("bn1.bias", (64,)),
    ("bn1.running_mean", (64,)),
    ("bn1.running_var", (64,)),
    ("bn1.num_batches_tracked", ()),
    ("layer1.0.conv1.weight", (64, 64, 3, 3)),
    ("layer1.0.bn1.weight", (64,)),
    ("layer1.0.bn1.bias", (64,)),
    ("layer1.0.bn1.running_mean", (64,)),
    ("layer1.0.bn1.running_var", (64,)),
    ("layer1.0.bn1.num_batches_tracked", ()),
    ("layer1.0.conv2.weight", (64, 64, 3, 3)),
    ("layer1.0.bn2.weight", (64,)),
    ("layer1.0.bn2.bias", (64,)),
    ("layer1.0.bn2.running_mean", (64,)),
    ("layer1.0.bn2.running_var", (64,)),
    ("layer1.0.bn2.num_batches_tracked", ()),
    ("layer1.1.conv1.weight", (64, 64, 3, 3)),
    ("layer1.1.bn1.weight", (64,)),
    ("layer1.1.bn1.bias", (64,)),
    ("layer1.1.bn1.running_mean", (64,)),
    ("layer1.1.bn1.running_var", (64,)),
    ("layer1.1.bn1.num_batches_tracked", ()),
    ("layer1.1.conv2.weight", (64, 64, 3, 3)),
    ("layer1.1.bn2.weight", (64,)),
    ("layer1.1.bn2.bias", (64,)),
    ("layer1.1.bn2.running_mean", (64,)),
    ("layer1.1.bn2.running_var", (64,)),
    ("layer1.1.bn2.num_batches_tracked", ()),
    ("layer2.0.conv1.weight", (128, 64, 3, 3)),
    ("layer2.0.bn1.weight", (128,)),
    ("layer2.0.bn1.bias", (128,)),
    ("layer2.0.bn1.running_mean", (128,)),
    ("layer2.0.bn1.running_var", (128,)),
    ("layer2.0.bn1.num_batches_tracked", ()),
    ("layer2.0.conv2.weight", (128, 128, 3, 3)),
    ("layer2.0.bn2.weight", (128,)),
    ("layer2.0.bn2.bias", (128,)),
    ("layer2.0.bn2.running_mean", (128,)),
    ("layer2.0.bn2.running_var", (128,)),
    ("layer2.0.bn2.num_batches_tracked", ()),
    ("layer2.0.downsample.0.weight", (128, 64, 1, 1)),
    ("layer2.0.downsample.1.weight", (128,)),
    ("layer2.0.downsample.1.bias", (128,)),
    ("layer2.0.downsample.1.running_mean", (128,)),
    ("layer2.0.downsample.1.running_var", (128,)),
    ("layer2.0.downsample.1.num_batches_tracked", ()),
    ("layer2.1.conv1.weight", (128, 128, 3, 3)),
    ("layer2.1.bn1.weight", (128,)),
    ("layer2.1.bn1.bias", (128,)),
    ("layer2.1.bn1.running_mean", (128,)),
    ("layer2.1.bn1.running_var", (128,)),
    ("layer2.1.bn1.num_batches_tracked", ()),
    ("layer2.1.conv2.weight", (128, 128, 3, 3)),
    ("layer2.1.bn2.weight", (128,)),
    ("layer2.1.bn2.bias", (128,)),
    ("layer2.1.bn2.running_mean", (128,)),
    ("layer2.1.bn2.running_var", (128,)),
    ("layer2.1.bn2.num_batches_tracked", ()),
    ("layer3.0.conv1.weight", (256, 128, 3, 3)),
    ("layer3.0.bn1.weight", (256,)),
    ("layer3.0.bn1.bias", (256,)),
    ("layer3.0.bn1.running_mean", (256,)),
    ("layer3.0.bn1.running_var", (256,)),
    ("layer3.0.bn1.num_batches_tracked", ()),
    ("layer3.0.conv2.weight", (256, 256, 3, 3)),
    ("layer3.0.bn2.weight", (256,)),
    ("layer3.0.bn2.bias", (256,)),
    ("layer3.0.bn2.running_mean", (256,)),
    ("layer3.0.bn2.running_var", (256,)),
    ("layer3.0.bn2.num_batches_tracked", ()),
    ("layer3.0.downsample.0.weight", (256, 128, 1, 1)),
    ("layer3.0.downsample.1.weight", (256,)),
    ("layer3.0.downsample.1.bias", (256,)),
    ("layer3.0.downsample.1.running_mean", (256,)),
    ("layer3.0.downsample.1.running_var", (256,)),
    ("layer3.0.downsample.1.num_batches_tracked", ()),
    ("layer3.1.conv1.weight", (256, 256, 3, 3)),
    ("layer3.1.bn1.weight", (256,)),
    ("layer3.1.bn1.bias", (256,)),
    ("layer3.1.bn1.running_mean", (256,)),
    ("layer3.1.bn1.running_var", (256,)),
    ("layer3.1.bn1.num_batches_tracked", ()),
    ("layer3.1.conv2.weight", (256, 256, 3, 3)),
    ("layer3.1.bn2.weight", (256,)),
    ("layer3.1.bn2.bias", (256,)),
    ("layer3.1.bn2.running_mean", (256,)),
    ("layer3.1.bn2.running_var", (256,)),
    ("layer3.1.bn2.num_batches_tracked", ()),
    ("layer4.0.conv1.weight", (512, 256, 3, 3)),
    ("layer4.0.bn1.weight", (512,)),
    ("layer4.0.bn1.bias", (512,)),
    ("layer4.0.bn1.running_mean", (512,)),
    ("layer4.0.bn1.running_var", (512,)),
    ("layer4.0.bn1.num_batches_tracked", ()),
    ("layer4.0.conv2.weight", (512, 512, 3, 3)),
    ("layer4.0.bn2.weight", (512,)),
    ("layer4.0.bn2.bias", (512,)),
    ("layer4.0.bn2.running_mean", (512,)),
    ("layer4.0.bn2.running_var", (512,)),
    ("layer4.0.bn2.num_batches_tracked", ()),
    ("layer4.0.downsample.0.weight", (512, 256, 1, 1)),
    ("layer4.0.downsample.1.weight", (512,)),
    ("layer4.0.downsample.1.bias", (512,)),
    ("layer4.0.downsample.1.running_mean", (512,)),
    ("layer4.0.downsample.1.running_var", (512,)),
    ("layer4.0.downsample.1.num_batches_tracked", ()),
    ("layer4.1.conv1.weight", (512, 512, 3, 3)),
    ("layer4.1.bn1.weight", (512,)),
    ("layer4.1.bn1.bias", (512,)),
    ("layer4.1.bn1.running_mean", (512,)),
    ("layer4.1.bn1.running_var", (512,)),
    ("layer4.1.bn1.num_batches_tracked", ()),
    ("layer4.1.conv2.weight", (512, 512, 3, 3)),
    ("layer4.1.bn2.weight", (512,)),
    ("layer4.1.bn2.bias", (512,)),
    ("layer4.1.bn2.running_mean", (512,)),
    ("layer4.1.bn2.running_var", (512,)),
    ("layer4.1.bn2.num_batches_tracked", ()),
    ("fc.weight", (10, 512)),
    ("fc.bias", (10,)),
]


def _shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


@pytest.mark.slow
def test_resnet18_matches_torchvision_state_dict() -> None:
    model = resnet18(num_classes=10)
    assert len(TORCHVISION_RESNET18_KEYS) == 122
    assert _shapes(model) == TORCHVISION_RESNET18_KEYS
    assert len(list(model.parameters())) == 62


def test_cifar_stem_keeps_key_names() -> None:
    model = resnet18(num_classes=10, cifar_stem=True)
    keys = [k for k, _ in _shapes(model)]
    assert keys == [k for k, _ in TORCHVISION_RESNET18_KEYS]
    assert tuple(model.state_dict()["conv1.weight"].shape) == (64, 3, 3, 3)
    assert model.conv1.stride == (1, 1) and model.conv1.padding == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)


@pytest.mark.slow
def test_resnet18_load_state_dict_strict() -> None:
    a, b = resnet18(), resnet18()
    b.load_state_dict(a.state_dict(), strict=True)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)


@pytest.mark.parametrize("cifar_stem", [False, True])
@pytest.mark.slow
def test_resnet18_forward_shape(cifar_stem: bool) -> None:
    torch.manual_seed(0)
    model = resnet18(num_classes=10, cifar_stem=cifar_stem).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()


@pytest.mark.slow
def test_resnet18_num_classes() -> None:
    model = resnet18(num_classes=7)
    assert model.fc.out_features == 7


def test_resnet18_init_like_torchvision() -> None:
    torch.manual_seed(0)
    model = resnet18()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0)
    # kaiming_normal_(fan_out, relu): std = sqrt(2 / (out_channels * kh * kw)).
    w = model.layer4[0].conv2.weight
    expected = math.sqrt(2.0 / (512 * 3 * 3))
    assert abs(w.std().item() - expected) / expected < 0.05


def test_digits_cnn_forward_shape() -> None:
    torch.manual_seed(0)
    model = DigitsCNN()
    out = model(torch.rand(5, 1, 8, 8))
    assert out.shape == (5, 10)


def test_digits_cnn_has_no_batchnorm_or_dropout() -> None:
    banned = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd, nn.GroupNorm)
    model = DigitsCNN()
    assert not any(isinstance(m, banned) for m in model.modules())
    assert not any(k.endswith(("running_mean", "running_var")) for k in model.state_dict())


def test_digits_cnn_layers() -> None:
    convs = [m for m in DigitsCNN().modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in DigitsCNN().modules() if isinstance(m, nn.Linear)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [
        (1, 32, (3, 3)),
        (32, 64, (3, 3)),
    ]
    assert [(lin.in_features, lin.out_features) for lin in linears] == [(1024, 128), (128, 10)]
