"""LR schedulers handed to ``rt.setup`` (:mod:`paratrain.runtime.schedulers`): they advance
only after an ``optimizer.step()`` that applied gradients, stay the user's class with the
user's ``state_dict()``, and a scheduler not handed over is warned about once.

In-process, ``--strategy cpu``; the GradScaler is torch's CPU one, the class fp16 on CUDA
uses.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, SequentialLR, StepLR

import paratrain
from paratrain.devices.precision import Precision
from paratrain.runtime.optim import RuntimeOptimizer
from paratrain.runtime.schedulers import gate_scheduler, is_scheduler
from paratrain.runtime.step_state import StepState
from paratrain.utils.errors import UserError

CPU = torch.device("cpu")


def _halving(optimizer: torch.optim.Optimizer) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: 0.5**step)


def _set_up(accumulate: int, **options: Any) -> tuple[paratrain.Runtime, nn.Module, Any, Any]:
    rt = paratrain.Runtime(strategy="cpu", seed=0, accumulate=accumulate, **options)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer, scheduler = rt.setup(model, optimizer, _halving(optimizer))
    return rt, model, optimizer, scheduler


def _micro_batch(rt: paratrain.Runtime, model: nn.Module, scale: float = 1.0) -> None:
    rt.backward(model(torch.ones(2, 3)).pow(2).mean() * scale)


def test_a_scheduler_advances_once_per_applied_step_under_accumulation() -> None:
    rt, model, optimizer, scheduler = _set_up(accumulate=2)
    rates = []
    for _ in range(6):  # three optimizer steps, the scheduler stepped after every call
        _micro_batch(rt, model)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == [1.0, 0.5, 0.5, 0.25, 0.25, 0.125]
    assert scheduler.last_epoch == 3


def test_a_scheduler_stepped_first_keeps_the_plain_loops_schedule() -> None:
    """``scheduler.step()`` before ``optimizer.step()`` (the old order, or once an epoch):
    the plain loop's learning rates reach the optimizer steps all the same."""

    def rates(accumulate: int) -> list[float]:
        rt, model, optimizer, scheduler = _set_up(accumulate)
        seen = []
        for _ in range(3 * accumulate):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch: "before optimizer.step()"
                scheduler.step()
            _micro_batch(rt, model)
            if rt.sync_gradients:
                seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            optimizer.zero_grad()
        return seen

    assert rates(2) == rates(1) == [0.5, 0.25, 0.125]


def test_the_scheduler_is_the_users_class_with_the_users_state_dict() -> None:
    _, _, optimizer, gated = _set_up(accumulate=2)
    plain = _halving(torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=1.0))
    assert isinstance(gated, LambdaLR) and type(gated) is not LambdaLR
    assert gated.state_dict().keys() == plain.state_dict().keys()
    gated.load_state_dict({**plain.state_dict(), "last_epoch": 7})
    assert gated.last_epoch == 7
    plain.load_state_dict(gated.state_dict())  # and back: the same file either way
    assert plain.last_epoch == 7
    copied = copy.deepcopy(gated)
    assert type(copied) is LambdaLR and copied.last_epoch == 7
    rt = paratrain.Runtime(strategy="cpu", seed=0, accumulate=2)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step_lr = rt.setup(model, optimizer, StepLR(optimizer, 2))[2]  # no lambda: picklable
    assert type(pickle.loads(pickle.dumps(step_lr))) is StepLR


def test_the_schedulers_torch_composes_are_gated() -> None:
    def gated(build: Any) -> Any:
        rt = paratrain.Runtime(strategy="cpu", seed=0, accumulate=2)
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        model, optimizer, scheduler = rt.setup(model, optimizer, build(optimizer))
        for _ in range(8):  # four applied steps of eight calls
            _micro_batch(rt, model)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        return scheduler

    def sequential(optimizer: torch.optim.Optimizer) -> SequentialLR:
        parts = [StepLR(optimizer, 1, gamma=0.5), StepLR(optimizer, 1, gamma=0.1)]
        return SequentialLR(optimizer, parts, milestones=[2])

    assert gated(sequential).last_epoch == 4
    # four steps of its own: a fifth would raise
    assert gated(lambda optimizer: OneCycleLR(optimizer, 1.0, total_steps=4)).last_epoch == 4


def test_a_scheduler_of_another_optimizer_or_without_one_is_refused() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0, accumulate=2)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    other = _halving(torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=1.0))
    with pytest.raises(UserError, match="schedules another optimizer than the one handed"):
        rt.setup(model, optimizer, other)
    with pytest.raises(UserError, match=r"hand the optimizer too, rt\.setup\(model, optimizer"):
        rt.setup(model, scheduler=_halving(optimizer))


def test_setup_returns_the_scheduler_in_its_place() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0, accumulate=2)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss_fn = nn.MSELoss()
    _, _, out_loss, scheduler = rt.setup(model, optimizer, loss_fn, _halving(optimizer))
    assert out_loss is loss_fn and isinstance(scheduler, LambdaLR)
    assert is_scheduler(scheduler) and not is_scheduler(loss_fn)
    # nothing to gate without accumulation, a GradScaler or the skip policy: untouched
    plain = paratrain.Runtime(strategy="cpu", seed=0)
    untouched = _halving(optimizer)
    assert plain.setup(model, optimizer, untouched)[2] is untouched


def test_a_step_skipped_for_a_non_finite_loss_does_not_advance_it() -> None:
    rt, model, optimizer, scheduler = _set_up(accumulate=1, nonfinite="skip")
    for scale in (1.0, float("nan"), 1.0):
        _micro_batch(rt, model, scale)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert scheduler.last_epoch == 2


def test_a_step_the_grad_scaler_skipped_does_not_advance_it() -> None:
    model = nn.Linear(3, 1)
    precision = Precision("fp16", CPU)
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    optimizer = RuntimeOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), precision, StepState()
    )
    scheduler = gate_scheduler(_halving(optimizer), optimizer, optimizer._paratrain_steps)
    for scale in (1.0, 1e38, 1.0):  # the second overflows once scaled: skipped
        precision.backward(model(torch.ones(2, 3)).pow(2).mean() * scale)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert scheduler.last_epoch == 2


class _Custom:
    """A scheduler of one's own: ``step()`` and ``state_dict()``, no torch base class."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}


class _Slotted:
    """One without a ``__dict__``: a proxy of it is returned."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}


def test_any_object_with_step_and_state_dict_is_gated() -> None:
    for made in (_Custom(), _Slotted()):
        rt = paratrain.Runtime(strategy="cpu", seed=0, accumulate=2)
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        model, optimizer, scheduler = rt.setup(model, optimizer, made)
        for _ in range(4):
            _micro_batch(rt, model)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        assert scheduler.state_dict() == {"steps": 2} and made.steps == 2
    # no __dict__ to share: a proxy, which isinstance() sees as the scheduler's class
    assert isinstance(scheduler, _Slotted) and type(scheduler) is not _Slotted


def test_a_scheduler_built_before_setup_and_not_handed_is_warned_about_once() -> None:
    """The optimizer still accumulates (the scheduler's patch of ``step`` goes through
    the runtime's wrapper), and the learning rate changed while nothing was applied is
    named, with the fix, in one warning."""
    rt = paratrain.Runtime(strategy="cpu", seed=0, accumulate=2)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = _halving(optimizer)
    model, optimizer = rt.setup(model, optimizer)
    before = model.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(6):
            _micro_batch(rt, model)
            optimizer.step()
            if index == 0:  # the first micro-batch changes nothing
                assert torch.equal(model.weight, before)
            optimizer.zero_grad()
            scheduler.step()
    said = [str(w.message) for w in caught if "applied no gradients" in str(w.message)]
    assert len(said) == 1
    assert "rt.setup(model, optimizer, scheduler)" in said[0]


def test_a_scheduler_handed_to_setup_is_not_warned_about() -> None:
    rt, model, optimizer, scheduler = _set_up(accumulate=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            _micro_batch(rt, model)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
