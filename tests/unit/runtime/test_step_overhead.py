"""The runtime's per-step path in one process (``--strategy cpu``): the finite-loss check,
read one step late on the quiet path, keeps every guarantee of the non-finite policies: a
NaN stops the run by the next step, or at the first checkpoint, final weights or collective
before it, naming its own step."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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


def test_a_nan_loss_stops_a_one_process_run_by_the_next_step_naming_its_own() -> None:
    rt = paratrain.Runtime(strategy="cpu")
    model, optimizer = _parts(rt)
    _step(rt, model, optimizer, bad=False)
    _step(rt, model, optimizer, bad=True)  # sent, read at the next step's check
    with pytest.raises(NonFiniteLossError, match="at step 2"):
        _step(rt, model, optimizer, bad=False)


@pytest.mark.parametrize("before", ["save", "save_weights", "settle", "all_reduce"])
def test_a_nan_loss_is_read_before_anything_is_written(tmp_path: Path, before: str) -> None:
    """rt.save, rt.save_weights, rt.settle and the runtime's collectives read the last
    step's check first: nothing is written from a step with a NaN loss."""
    rt = paratrain.Runtime(strategy="cpu")
    model, optimizer = _parts(rt)
    _step(rt, model, optimizer, bad=True)
    calls = {
        "save": lambda: rt.save(tmp_path / "state.pt", {"model": model}),
        "save_weights": lambda: rt.save_weights(model, tmp_path / "model.safetensors"),
        "settle": rt.settle,
        "all_reduce": lambda: rt.all_reduce(torch.ones(1)),
    }
    with pytest.raises(NonFiniteLossError, match="at step 1"):
        calls[before]()
    assert not list(tmp_path.iterdir())


def test_a_nan_micro_batch_is_found_at_the_end_of_its_step() -> None:
    rt = paratrain.Runtime(strategy="cpu", accumulate=2)
    model, optimizer = _parts(rt)
    _step(rt, model, optimizer, bad=True)  # deferred: no check inside the group
    _step(rt, model, optimizer, bad=False)  # the group's check, sent
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


class _Ops(TorchDispatchMode):
    """The aten operations dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _backward_ops(backward: Any, model: nn.Module) -> list[str]:
    """The operations of one backward of ``model``'s loss, after three steps."""
    x = torch.ones(4, 3)
    for _ in range(3):
        backward(model(x).sum())
    loss = model(x).sum()
    with _Ops() as ops:
        backward(loss)
    return ops.seen


def test_a_quiet_step_of_one_process_adds_one_operation_to_the_backward() -> None:
    """--strategy cpu, the default checks: the loss's check is read a step later, on the
    host, from the loss itself (detached); no tensor is computed for it on the quiet path,
    whose every operation costs microseconds on a small model's step."""
    rt = paratrain.Runtime(strategy="cpu")
    model, _ = _parts(rt)
    torch.manual_seed(0)
    plain = nn.Linear(3, 1)
    own = Counter(_backward_ops(rt.backward, model))
    own.subtract(Counter(_backward_ops(torch.Tensor.backward, plain)))
    assert +own == Counter({"aten.detach.default": 1}), own
