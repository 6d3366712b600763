"""Gradient accumulation under ddp: ``rt.accumulate(model)`` skips the all-reduce on every
micro-step but the last of each group, and accumulate=N with micro-batch B/N trains the same
weights as batch B."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.checkpoints.weights import unwrap_model

pytestmark = pytest.mark.slow  # real processes, or several layers at work


GLOBAL_BATCH = 24
ACCUMULATE = 4


def _train(rt: paratrain.Runtime, batch_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    all_reduces = [0]
    if isinstance(model, DistributedDataParallel):
        # No annotations: DDP rejects a hook whose bucket annotation is not a GradBucket.
        def counting_hook(state, bucket):
            all_reduces[0] += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(96, 6, generator=generator), torch.randn(96, 2, generator=generator)
    loader = rt.setup_loader(DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True))
    steps = micro_steps = 0
    for _epoch in range(2):
        for xb, yb in loader:
            with rt.accumulate(model):
                rt.backward(nn.functional.mse_loss(model(xb), yb))
            steps += rt.sync_gradients
            micro_steps += 1
            optimizer.step()
            optimizer.zero_grad()
    weights = {k: v.detach().cpu() for k, v in unwrap_model(model).state_dict().items()}
    return {"weights": weights, "all_reduces": all_reduces[0], "steps": steps, "micro": micro_steps}


def test_accumulation_skips_all_reduces_and_matches_the_big_batch() -> None:
    big = paratrain.Runtime(strategy="cpu", seed=0).launch(_train, GLOBAL_BATCH)
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", accumulate=ACCUMULATE, seed=0)
    accumulated = rt.launch(_train, GLOBAL_BATCH // ACCUMULATE)
    assert big is not None and accumulated is not None
    assert accumulated["micro"] == ACCUMULATE * accumulated["steps"] == ACCUMULATE * big["steps"]
    # One gradient bucket (a small model): one all-reduce per optimizer step, none on the
    # micro-steps in between.
    assert accumulated["all_reduces"] == accumulated["steps"] == 8
    diff = max(
        (big["weights"][k] - accumulated["weights"][k]).abs().max().item() for k in big["weights"]
    )
    print(
        f"\naccumulate {ACCUMULATE} x {GLOBAL_BATCH // ACCUMULATE} on ddp 2 vs batch "
        f"{GLOBAL_BATCH} on cpu: max abs diff {diff:.3g}"
    )
    assert diff < 1e-5
