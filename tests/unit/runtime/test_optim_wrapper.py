"""The optimizer ``rt.setup`` returns under fp16 or accumulation (``RuntimeOptimizer``):
it steps through the GradScaler, fused kernels included, and clears gradients as asked.

In-process, ``--strategy cpu``; the GradScaler is torch's CPU one, the class fp16 on CUDA
uses.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.data.loaders import BatchInfo
from paratrain.devices.precision import Precision
from paratrain.runtime.optim import RuntimeOptimizer, move_optimizer_state
from paratrain.runtime.step_state import StepState

CPU = torch.device("cpu")


def _steps(fused: bool, scaled: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    precision = Precision("fp16", CPU)
    if scaled:
        precision.scaler = torch.amp.GradScaler("cpu")
    optimizer = RuntimeOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.1, fused=fused), precision, StepState()
    )
    for _ in range(3):
        optimizer.zero_grad()
        precision.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    return model


def test_a_fused_step_gets_the_scale_from_the_grad_scaler() -> None:
    """A fused Adam unscales in its kernel: GradScaler hands it ``grad_scale`` and
    ``found_inf`` through the wrapper; the model is the unscaled, unfused one's."""
    reference = _steps(fused=False, scaled=False)
    for fused in (False, True):
        model = _steps(fused=fused, scaled=True)
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_zero_grad_keeps_or_drops_the_gradient_tensors_as_asked() -> None:
    model = nn.Linear(2, 1)
    optimizer = RuntimeOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), Precision("32", CPU), StepState()
    )
    model(torch.ones(1, 2)).sum().backward()
    optimizer.zero_grad(set_to_none=False)
    assert model.weight.grad is not None and not model.weight.grad.any()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    assert model.weight.grad is None


def test_accumulation_applies_every_nth_micro_batch_and_at_the_epoch_end() -> None:
    three = StepState(3)
    seen = []
    for _ in range(3):
        last = three.ends_group
        three.micro_batch_done()
        seen.append((last, three.sync_gradients, three.micro_steps))
    assert seen == [(False, False, 1), (False, False, 2), (True, True, 3)]
    three.applied()
    assert (three.micro_steps, three.sync_gradients) == (0, False)
    three.begin(BatchInfo(ends_epoch=True))  # the epoch's last batch ends an unfinished group
    assert three.ends_group
    three.micro_batch_done()
    assert three.sync_gradients
    two = StepState(2)
    two.micro_batch_done()
    assert not two.sync_gradients
    two.micro_batch_done()
    assert two.sync_gradients
    one = StepState(1)
    for _ in range(2):
        assert one.ends_group
        one.micro_batch_done()
        assert (one.micro_steps, one.sync_gradients) == (0, True)
    one.applied()
    assert (one.micro_steps, one.sync_gradients) == (0, True)


def test_step_passes_the_closure_to_the_optimizer() -> None:
    model = nn.Linear(2, 1)
    optimizer = RuntimeOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), Precision("32", CPU), StepState()
    )
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    assert isinstance(optimizer.step(closure), torch.Tensor)
    assert calls == [1]


def test_step_then_zero_grad_keeps_the_first_micro_batches_gradients() -> None:
    """Under ``accumulate=2`` a loop that calls ``step()`` then ``zero_grad()`` after every
    micro-batch must not lose the first micro-batch's gradients."""
    model = nn.Linear(2, 1)
    accumulation = StepState(2)
    optimizer = RuntimeOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), Precision("32", CPU), accumulation
    )
    model(torch.ones(1, 2)).sum().backward()
    accumulation.micro_batch_done()
    optimizer.step()
    optimizer.zero_grad()
    assert model.weight.grad is not None and torch.equal(model.weight.grad, torch.ones(1, 2))
    for _ in range(2):  # the group's last micro-batch applies, then gradients are cleared
        model(torch.ones(1, 2)).sum().backward()
        accumulation.micro_batch_done()
        optimizer.step()
        optimizer.zero_grad()
        assert model.weight.grad is None
        model(torch.ones(1, 2)).sum().backward()  # the next group's first micro-batch
        accumulation.micro_batch_done()
        optimizer.step()
        optimizer.zero_grad()
        assert model.weight.grad is not None


def test_moving_optimizer_state_keeps_what_is_not_a_tensor() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.state[model.weight] = {"count": 3, "buffer": torch.ones(2)}
    move_optimizer_state(optimizer, CPU)
    assert optimizer.state[model.weight]["count"] == 3
    assert torch.equal(optimizer.state[model.weight]["buffer"], torch.ones(2))
