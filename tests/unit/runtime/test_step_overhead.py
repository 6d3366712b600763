"""The runtime's per-step path in one process (``--strategy cpu``): the finite-loss check
reads a loss of the CPU at once (there is no device to wait for) and costs no tensor
operation; a NaN stops the run at its own step, before its backward, naming it. Off the CPU
(and with several processes) the check is read a step late, and a NaN is acted on before any
checkpoint, final weights or collective: ``ddp`` on ``cpu,cpu`` shows that path here."""

from __future__ import annotations

import functools
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


def test_a_nan_loss_stops_a_one_process_cpu_run_at_its_own_step_before_its_backward() -> None:
    rt = paratrain.Runtime(strategy="cpu")
    model, optimizer = _parts(rt)
    _step(rt, model, optimizer, bad=False)
    after_one = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteLossError, match="at step 2"):
        _step(rt, model, optimizer, bad=True)
    assert all(p.grad is None for p in model.parameters())  # its backward never ran
    assert all(torch.equal(a, b) for a, b in zip(after_one, model.parameters(), strict=True))


def test_a_nan_micro_batch_is_found_at_once_naming_its_step() -> None:
    rt = paratrain.Runtime(strategy="cpu", accumulate=2)
    model, optimizer = _parts(rt)
    with pytest.raises(NonFiniteLossError, match="at step 1"):
        _step(rt, model, optimizer, bad=True)  # the first micro-batch of step 1


def _nan_read_before_writing(rt: paratrain.Runtime, folder: str) -> dict[str, str]:
    """In each ddp process: a NaN on rank 1, sent and not read yet, then each of the calls
    that write or communicate: it is read there, before anything is written."""
    out = Path(folder)
    found = {}
    for name in ("save", "save_weights", "settle", "all_reduce"):
        model, optimizer = _parts(rt)  # its own model: the NaN before is in the last one's
        calls = {
            "save": functools.partial(rt.save, out / "state.pt", {"model": model}),
            "save_weights": functools.partial(rt.save_weights, model, out / "model.safetensors"),
            "settle": rt.settle,
            "all_reduce": functools.partial(rt.all_reduce, torch.ones(1)),
        }
        _step(rt, model, optimizer, bad=rt.rank == 1)  # sent: read at the next agreement
        try:
            calls[name]()
            found[name] = "no error"
        except NonFiniteLossError as exc:
            found[name] = str(exc)
    return found


@pytest.mark.slow
def test_a_nan_loss_is_read_before_anything_is_written(tmp_path: Path) -> None:
    """ddp on cpu,cpu, the agreement read late (agreement_seconds=1000): rt.save,
    rt.save_weights, rt.settle and the runtime's collectives read the last step's check
    first; nothing is written from a step with a NaN loss."""
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", agreement_seconds=1000)
    found = rt.launch(_nan_read_before_writing, str(tmp_path))
    assert found is not None
    for step, name in enumerate(["save", "save_weights", "settle", "all_reduce"], start=1):
        assert f"NaN or infinite on rank 1 at step {step};" in found[name], (name, found)
    assert not list(tmp_path.iterdir())


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


def test_a_quiet_step_of_one_process_adds_no_operation_to_the_backward() -> None:
    """--strategy cpu, the default checks: the loss's check reads the loss on the host (no
    device to wait for); no tensor is made or computed for it, whose every operation costs
    microseconds on a small model's step."""
    rt = paratrain.Runtime(strategy="cpu")
    model, _ = _parts(rt)
    torch.manual_seed(0)
    plain = nn.Linear(3, 1)
    own = Counter(_backward_ops(rt.backward, model))
    own.subtract(Counter(_backward_ops(torch.Tensor.backward, plain)))
    assert +own == Counter(), own
