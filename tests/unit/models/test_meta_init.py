"""Models built on the meta device (paratrain.models.meta_init), in this process, on the CPU.

fsdp and pipeline on ``cpu,cpu`` building only their part, with the weights of a one-process
build: tests/test_fsdp.py and tests/test_pipeline.py. Peak memory per process:
benchmarks/meta_init_memory.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.models import GPT, resnet18
from paratrain.models.meta_init import MetaInit, is_meta


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(width=32, depth=3)


def test_weights_depend_on_seed_and_name_not_on_order_or_parts() -> None:
    whole = _meta_gpt()
    MetaInit(whole, seed=3).materialize([whole])
    parts = _meta_gpt()
    init = MetaInit(parts, seed=3)
    for block in reversed(parts.blocks):  # another order, one block at a time
        init.materialize([block])
        assert is_meta(parts)
    init.materialize([parts])
    assert not is_meta(parts)
    same = whole.state_dict()
    assert all(torch.equal(v, same[k]) for k, v in parts.state_dict().items())
    other = _meta_gpt()
    MetaInit(other, seed=4).materialize([other])
    assert not torch.equal(other.blocks[0].qkv.weight, whole.blocks[0].qkv.weight)
    # every block the same shape, yet each its own draw
    assert not torch.equal(whole.blocks[0].qkv.weight, whole.blocks[1].qkv.weight)
    # the model's own initialisation (init_module) is used: positions with std 0.02
    assert 0.015 < whole.position.std().item() < 0.025


@pytest.mark.slow
def test_resnet_gets_its_constructor_initialisation_and_keeps_the_generator() -> None:
    """--strategy cpu: ResNet's Kaiming convolutions and BatchNorm ones and zeros, through
    the Runtime; the global generator is where it was."""
    with torch.device("meta"):
        model = resnet18(num_classes=10)
    rt = paratrain.Runtime("cpu", seed=5)
    state = torch.get_rng_state()
    model = rt.setup(model)
    assert torch.equal(torch.get_rng_state(), state)
    fan_out = 64 * 3 * 3  # kaiming_normal_, mode="fan_out", relu gain
    std = model.layer1[0].conv1.weight.std().item()
    assert abs(std - (2 / fan_out) ** 0.5) < 0.1 * (2 / fan_out) ** 0.5
    assert torch.equal(model.bn1.weight, torch.ones(64))
    assert torch.equal(model.bn1.running_var, torch.ones(64))
    assert int(model.bn1.num_batches_tracked) == 0


def test_tied_weights_stay_tied() -> None:
    with torch.device("meta"):
        model = GPT(width=32, depth=2, tie=True)
    MetaInit(model, seed=0).materialize([model])
    assert model.head.weight is model.embed.weight and not model.head.weight.is_meta


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))  # no reset_parameters: nothing sets it


def test_a_parameter_no_initialiser_sets_is_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())
    with pytest.raises(paratrain.UserError, match=r"1\.gain of the model built on the meta"):
        MetaInit(model, seed=0).materialize([model])


def test_a_meta_model_without_a_seed_is_refused() -> None:
    with pytest.raises(paratrain.UserError, match="pass Runtime\\(seed=N\\)"):
        paratrain.Runtime("cpu").setup(_meta_gpt())
