"""``batch_size_per="process"``: a ported DDP script keeps its effective batch.

Under ddp with N processes, a loader of batch b per process trains on global batches of
N x b, so it must give the model one process gives with the global batch N x b.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.checkpoints.weights import unwrap_model
from paratrain.runtime.batching import global_batch_size
from paratrain.utils.errors import UserError

pytestmark = pytest.mark.slow  # real processes, or several layers at work


TOLERANCE = 1e-5


def _train(rt: paratrain.Runtime, batch_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(
        torch.randn(100, 6, generator=generator), torch.randn(100, 1, generator=generator)
    )
    loader = rt.setup_loader(DataLoader(data, batch_size=batch_size, shuffle=True))
    sizes = []
    for _epoch in range(2):
        for x, y in loader:  # 100 samples: three full global batches of 32 and one of 4
            sizes.append(int(rt.all_reduce(torch.tensor(len(x)), "sum")))
            rt.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    weights = {k: v.detach().cpu() for k, v in unwrap_model(model).state_dict().items()}
    return {"weights": weights, "global_batches": sizes}


def test_ddp_batch_per_process_equals_one_process_with_the_global_batch() -> None:
    one = paratrain.Runtime(strategy="cpu", seed=0).launch(_train, 32)
    ddp = paratrain.Runtime(
        strategy="ddp", devices="cpu,cpu", batch_size_per="process", seed=0
    ).launch(_train, 16)
    assert one is not None and ddp is not None
    assert ddp["global_batches"] == one["global_batches"] == [32, 32, 32, 4] * 2
    diff = max((ddp["weights"][k] - one["weights"][k]).abs().max().item() for k in one["weights"])
    print(f"\nddp 2 x batch 16 per process vs cpu batch 32: max abs diff {diff:.3g}")
    assert diff < TOLERANCE


def test_one_process_and_dataparallel_batches_are_unchanged() -> None:
    # dp and dp-balanced are one process that splits its batch: the two meanings agree.
    data = TensorDataset(torch.arange(20.0).unsqueeze(1))
    for strategy, devices in (("cpu", None), ("dp-balanced", "cpu,cpu")):
        rt = paratrain.Runtime(strategy=strategy, devices=devices, batch_size_per="process", seed=0)
        loader = rt.setup_loader(DataLoader(data, batch_size=8))
        assert [len(x) for (x,) in loader] == [8, 8, 4]


def test_global_batch_arithmetic_and_bad_values() -> None:
    assert global_batch_size(16, "process", 4) == 64
    assert global_batch_size(16, "global", 4) == 16
    with pytest.raises(UserError, match="batch_size_per must be one of global, process"):
        paratrain.Runtime(strategy="cpu", batch_size_per="device", seed=0)


def test_cli_batch_size_per_process(paratrain_here: CLI, tmp_path: Path) -> None:
    args = ["train", "--recipe", "linear", "--epochs", "1", "--no-progress", "--batch-size", "10"]
    two = paratrain_here(
        *args,
        "--strategy",
        "ddp",
        "--devices",
        "cpu,cpu",
        "--batch-size-per",
        "process",
        "--out",
        "two",
    )
    assert two.returncode == 0, two.stderr
    saved = json.loads((tmp_path / "two/config.json").read_text())
    assert saved["config"]["batch_size_per"] == "process"
    assert saved["summary"]["steps"] == 50  # 1,000 samples in global batches of 2 x 10
    # The global batch depends on the process count: resuming with another count is refused.
    resume = ["train", "--resume", str(tmp_path / "two"), "--epochs", "2", "--strategy", "cpu"]
    refused = paratrain_here(*resume)
    assert refused.returncode == 2 and "with 2 process(es)" in refused.stderr
    refused = paratrain_here(*args, "--batch-size-per", "device")
    assert refused.returncode == 2 and "invalid choice: 'device'" in refused.stderr
