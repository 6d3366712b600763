"""The runtime's per-step path in one process (``--strategy cpu``): the cheap finite-loss
check keeps every guarantee of the non-finite policies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.runtime.nonfinite import POLICY_VARIABLE
from paratrain.utils.errors import NonFiniteLossError


def _step(
    rt: paratrain.Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, bad: bool
) -> None:
    loss = model(torch.ones(2, 3)).sum()
    rt.backward(loss * float("nan") if bad else loss)
    optimizer.step()
    optimizer.zero_grad()


def _parts(rt: paratrain.Runtime) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, 1)
    return rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[no-any-return]


def test_a_nan_loss_still_stops_a_one_process_run_at_its_step() -> None:
    rt = paratrain.Runtime(strategy="cpu")
    model, optimizer = _parts(rt)
    _step(rt, model, optimizer, bad=False)
    with pytest.raises(NonFiniteLossError, match="at step 2"):
        _step(rt, model, optimizer, bad=True)


def test_a_nan_micro_batch_is_found_at_the_end_of_its_step() -> None:
    rt = paratrain.Runtime(strategy="cpu", accumulate=2)
    model, optimizer = _parts(rt)
    _step(rt, model, optimizer, bad=True)  # deferred: no check inside the group
    with pytest.raises(NonFiniteLossError, match="at step 1"):
        _step(rt, model, optimizer, bad=False)


def test_skip_skips_the_nan_step_and_trains_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_VARIABLE, "skip")
    rt = paratrain.Runtime(strategy="cpu")
    model, optimizer = _parts(rt)
    before = [p.detach().clone() for p in model.parameters()]
    _step(rt, model, optimizer, bad=True)
    assert rt.step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    _step(rt, model, optimizer, bad=False)
    assert not rt.step_skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
