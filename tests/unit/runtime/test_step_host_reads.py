"""No host read inside a steady-state step: the CPU may run ahead of the device.

A step's checks (a non-finite loss, the stop on a signal, every process at the same step)
travel in one small all-reduce that is read one step later, from a host copy made without
waiting (:mod:`paratrain.runtime.agreement`). Counted here with a dispatch mode: the aten
calls that read a tensor's value on the host (``item()``, ``bool(t)``, ``torch.equal``)
made during five steps of a user's loop after three warm-up steps, with the default checks
on and ``rt.should_stop()`` after every step.

Devices: ``--strategy cpu`` in this process; ``ddp`` on ``cpu,cpu`` (two gloo processes).
On CUDA the same count holds, and the read of the host copy waits only for a step the
device finished long ago. (One process on the CPU reads its loss at once with ``tolist``,
which is no aten call: there is no device to wait for.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

import paratrain

#: the aten operations that bring a tensor's value to the host
HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}


class HostReads(TorchDispatchMode):
    """Counts the host reads dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in HOST_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _reads(rt: paratrain.Runtime) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    loader = rt.setup_loader(DataLoader(data, batch_size=16, shuffle=True))
    counter = HostReads()
    for index, (x, y) in enumerate(loader):
        if index == 3:
            counter.__enter__()
        rt.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        rt.should_stop()
        if index == 7:
            counter.__exit__(None, None, None)
            break
    rt.settle()
    return counter.seen


def test_no_host_read_in_a_steady_step_of_one_process() -> None:
    """--strategy cpu."""
    assert _reads(paratrain.Runtime("cpu", seed=0)) == []


def _launched(rt: paratrain.Runtime) -> list[str]:
    return _reads(rt)


@pytest.mark.slow
def test_no_host_read_in_a_steady_ddp_step() -> None:
    """ddp on cpu,cpu: the step's agreement is sent, and read at the next step."""
    rt = paratrain.Runtime("ddp", devices="cpu,cpu", seed=0)
    assert rt.launch(_launched) == []
