"""``rt.join(model)``'s context (paratrain.runtime.uneven) in this process: a real gloo group of one
process (`--strategy ddp` on `cpu`), so that its DDP model is a real one. The launched runs
with uneven ranks are in test_resilience.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.runtime.step_state import StepState
from paratrain.runtime.uneven import join_uneven


def _ddp_of_one() -> DistributedDataParallel:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return DistributedDataParallel(nn.Linear(2, 1))  # the group is destroyed by conftest


def test_join_makes_the_finite_check_local_and_restores_it() -> None:
    model, check = _ddp_of_one(), StepState()
    with join_uneven(model, check):
        assert check.local_only is True
        model(torch.ones(3, 2)).sum().backward()  # DDP's all-reduce runs under Join
    assert check.local_only is False
    assert model.module.weight.grad is not None
    with pytest.raises(RuntimeError, match="inside"), join_uneven(model, check):
        raise RuntimeError("inside")
    assert check.local_only is False  # also when the body raised


def test_a_model_without_ddp_is_left_alone() -> None:
    check = StepState()
    with join_uneven(nn.Linear(2, 1), check):  # Join would refuse a module without DDP
        assert check.local_only is False
