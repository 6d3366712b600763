"""What rt.setup_loader and the runtime's collectives refuse, in one line, rather than give
another layout's result: a stand-in sample in SyncBatchNorm's statistics, an iterable data
set under fsdp's collective forwards, a combination over something that is not data or
processes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.data.loaders import DeviceLoader
from paratrain.data.paths import setup_data_path
from paratrain.runtime.setup import _refuse_stand_in_statistics, _refuse_uneven_forwards
from paratrain.utils.errors import UserError


def _loader(n: int, rank: int, drop_last: bool = False) -> DeviceLoader:
    data = DataLoader(TensorDataset(torch.arange(n)), batch_size=4, drop_last=drop_last)
    return setup_data_path(
        data,
        device=torch.device("cpu"),
        rank=rank,
        world_size=2,
        seed=0,
        evaluation=False,
        sink=None,
    )


def test_sync_batchnorm_refuses_a_last_batch_smaller_than_the_processes() -> None:
    with pytest.raises(UserError) as raised:
        _refuse_stand_in_statistics(_loader(9, rank=1), 2)
    assert str(raised.value) == (
        "--sync-batchnorm: the epoch's last batch has 1 sample(s), fewer than the 2 "
        "processes, and a process with none of them has no batch statistics; choose a batch "
        "size that leaves at least 2, or drop it with DataLoader(drop_last=True)"
    )
    _refuse_stand_in_statistics(_loader(10, rank=1), 2)
    _refuse_stand_in_statistics(_loader(9, rank=1, drop_last=True), 2)


def test_fsdp_refuses_an_iterable_data_set_on_several_processes() -> None:
    rt = paratrain.Runtime(strategy="fsdp", devices="cpu,cpu")
    with pytest.raises(
        UserError, match=r"^--strategy fsdp: an IterableDataset cannot be evaluated"
    ):
        _refuse_uneven_forwards(rt.strategy, 2)
    _refuse_uneven_forwards(paratrain.Runtime(strategy="ddp", devices="cpu,cpu").strategy, 2)


def test_collectives_combine_over_data_or_processes() -> None:
    rt = paratrain.Runtime(strategy="cpu")
    tensor = torch.tensor([1.0, 2.0])
    assert rt.all_reduce(tensor, over="processes") is tensor
    assert rt.all_gather(tensor, over="processes") == [tensor]
    with pytest.raises(UserError, match=r"^over='stages': use one of 'data', 'processes'$"):
        rt.all_reduce(tensor, over="stages")


@pytest.mark.parametrize(
    ("strategy", "devices", "rate", "noted"),
    [
        ("dp-balanced", "cpu,cpu", 0.1, True),
        ("dp-balanced", "cpu,cpu", 0.0, False),
        ("cpu", "cpu", 0.1, False),
    ],
)
def test_dropout_on_several_devices_is_said_once(
    strategy: str, devices: str, rate: float, noted: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    """dp-balanced on cpu,cpu (threads in this process), cpu: each device draws its own
    dropout masks, so the weights are not one process's; rt.setup says it, once."""
    rt = paratrain.Runtime(strategy=strategy, devices=devices)
    for _ in range(2):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(rate))
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss())
    said = capfd.readouterr().err.count("the model has dropout (1 dropout layer, p up to 0.1)")
    assert said == (1 if noted else 0)
