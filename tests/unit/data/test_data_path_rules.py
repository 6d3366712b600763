"""How ``rt.setup_loader(data_path=...)`` chooses (paratrain.data.paths), called directly in
this process on the CPU (`--strategy cpu`): the budget's arithmetic and each reason a path
does not apply. test_data_paths.py checks that the paths give the same batches."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from paratrain.data.batched_loader import TensorBatchLoader
from paratrain.data.loaders import PLAIN_BATCH, batch_info
from paratrain.data.paths import (
    _device_unfit,
    check_data_path,
    device_budget_bytes,
    setup_data_path,
)
from paratrain.data.tensor_data import TensorRows, tensor_rows
from paratrain.runtime.step_state import StepState
from paratrain.utils.errors import UserError

CPU = torch.device("cpu")


def _setup(loader: DataLoader[Any], data_path: str, **kwargs: Any) -> Any:
    kwargs.setdefault("seed", 0)
    return setup_data_path(
        loader,
        device=CPU,
        rank=0,
        world_size=1,
        evaluation=False,
        sink=StepState(),
        data_path=data_path,
        **kwargs,
    )


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(8.0).reshape(8, 1))


@pytest.mark.parametrize("budget", [0.0, -1.0, math.inf, math.nan])
def test_a_budget_must_be_a_positive_finite_figure(budget: float) -> None:
    with pytest.raises(UserError, match=f"positive GiB figure, got {budget}"):
        check_data_path("auto", budget)


def test_arguments_that_apply() -> None:
    check_data_path("device", 0.5, torch.device("cuda", 0))
    check_data_path("batched", None, CPU)
    check_data_path("device")  # the device is not known yet: decided when set up
    with pytest.raises(
        UserError, match="it needs a CUDA or MPS device, and this process trains on cpu"
    ):
        check_data_path("device", None, CPU)


def test_the_budget_in_bytes() -> None:
    assert device_budget_bytes(CPU, 1.5) == 3 * 2**29
    assert device_budget_bytes(torch.device("cuda", 0), 0.25) == 2**28
    assert device_budget_bytes(CPU, None) is None  # the CPU says no free memory of its own


def test_auto_and_batched_cut_batches_in_host_memory_on_the_cpu() -> None:
    for data_path in ("auto", "batched"):
        loader = _setup(DataLoader(_data(), batch_size=4), data_path)
        assert isinstance(loader, TensorBatchLoader) and loader.data_path == "batched"
        assert [b[0].flatten().tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (
        _setup(DataLoader(_data(), batch_size=4), "auto", device_budget_gib=8.0).data_path
        == "batched"
    )
    with pytest.raises(UserError, match='"device" does not apply: it needs a CUDA or MPS'):
        _setup(DataLoader(_data(), batch_size=4), "device")


@pytest.mark.parametrize(
    ("loader", "reason"),
    [
        (
            lambda: DataLoader(_data(), batch_size=4, num_workers=2),
            "num_workers=2 (tensors need none)",
        ),
        (lambda: DataLoader(_data(), batch_size=4, collate_fn=list), "its own collate_fn"),
    ],
)
def test_loaders_whose_batches_cannot_be_cut(loader: Any, reason: str) -> None:
    assert _setup(loader(), "auto").data_path == "loader"
    with pytest.raises(UserError) as raised:
        _setup(loader(), "batched")
    assert str(raised.value) == (
        f'data path "batched" does not apply: the loader has {reason}; use "loader" or "auto"'
    )


def test_defaults_global_batch_and_agreed_order_reach_the_sampler() -> None:
    plain = setup_data_path(
        DataLoader(_data(), batch_size=4),
        device=CPU,
        rank=0,
        world_size=1,
        seed=0,
        evaluation=False,
        sink=None,
    )
    assert plain.data_path == "batched"  # "auto" unless told
    loader = DataLoader(_data(), batch_size=4, shuffle=True)
    agreed = _setup(loader, "batched", batch_size=2, agree=lambda drawn: 123, seed=None)
    expected = torch.randperm(8, generator=torch.Generator().manual_seed(123))
    batches = [b[0].flatten() for b in agreed]
    assert len(batches) == 4 and torch.equal(torch.cat(batches), expected.float())


def test_a_loader_with_its_own_sampler_is_told_how_to_build_one() -> None:
    with pytest.raises(UserError) as raised:
        _setup(DataLoader(_data(), batch_size=None), "batched")
    assert str(raised.value) == (
        'data path "batched" does not apply: the loader has its own sampler or batch_sampler, '
        "or no batch_size; build it with batch_size and shuffle=True or False; "
        'use "loader" or "auto"'
    )


def test_auto_falls_back_to_the_sharded_loader_whole() -> None:
    sink = StepState()
    own = DataLoader(_data(), batch_size=4, collate_fn=lambda rows: default_collate(rows))
    loader = setup_data_path(
        own, device=CPU, rank=0, world_size=1, seed=0, evaluation=False, sink=sink
    )
    assert loader.data_path == "loader" and loader.device == CPU and not loader.evaluation
    seen = [(b[0].flatten().tolist(), (batch_info(b) or PLAIN_BATCH).ends_epoch) for b in loader]
    assert seen == [([0, 1, 2, 3], False), ([4, 5, 6, 7], True)]
    assert loader.epoch == 0


def test_data_exactly_the_budget_fits() -> None:
    rows = tensor_rows(TensorDataset(torch.zeros(256, 1024)))  # 1 MiB
    assert isinstance(rows, TensorRows)
    cuda = torch.device("cuda", 0)  # the budget is given: nothing asks the device
    assert _device_unfit(rows, cuda, 1 / 1024) is None
    assert _device_unfit(rows, cuda, 1 / 2048) is not None
