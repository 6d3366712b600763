"""--oom auto: running out of memory halves the micro-batch and redoes the step, the same
model as a run that used the smaller micro-batch from the start.

In-process tests run on ``--strategy cpu``; the launched ones on ``cpu,cpu`` (ddp, fsdp).
``PARATRAIN_TEST_OOM=RANK:ABOVE[:STEP]`` (the suite's fault injection plug-in,
tests/plugins) raises ``torch.OutOfMemoryError`` where a GPU would run out.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from paratrain_test_faults import OOM_VARIABLE
from safetensors.torch import load_file
from torch import nn

import paratrain
from paratrain.runtime.oom import MicroBatches, OutOfMemoryStop
from paratrain.runtime.seeding import seed_everything
from paratrain.training.config import TrainConfig
from paratrain.training.loop import train
from paratrain.training.recipes import get_recipe

pytestmark = pytest.mark.slow  # real processes, or several layers at work


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.2), nn.Linear(16, 3))


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _grads(split: int, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
    """Gradients and BatchNorm statistics after one micro-batch (pieces: ``split`` at
    first), the runtime, and the next numbers of the random stream."""
    rt = paratrain.Runtime("cpu", oom="auto")
    rt.micro_batches.split = split
    model = _model()  # seeds: the dropout masks of both runs come from one stream
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rt.forward_backward(model, nn.functional.cross_entropy, x, y)
    state = [p.grad.clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]
    return state, (rt, torch.rand(3))


@pytest.mark.parametrize(("limit", "split"), [(16, 2), (8, 4)])
def test_dropped_forwards_leave_no_trace(
    monkeypatch: pytest.MonkeyPatch, limit: int, split: int
) -> None:
    """--strategy cpu: 32 samples where only ``limit`` fit: the micro-batch is halved until
    its pieces fit, and gradients, BatchNorm statistics and the random stream equal a run
    that cut it into ``split`` pieces from the start, bit for bit."""
    x, y = _data(32)
    monkeypatch.setenv(OOM_VARIABLE, f"0:{limit}")
    failed, (rt, after_failed) = _grads(1, x, y)
    assert rt.micro_batches.split == split and rt.micro_batches.piece_samples == limit
    monkeypatch.delenv(OOM_VARIABLE)
    clean, (_, after_clean) = _grads(split, x, y)
    assert torch.equal(after_failed, after_clean)
    assert all(torch.equal(a, b) for a, b in zip(failed, clean, strict=True))
    unpieced, _ = _grads(1, x, y)  # pieces do change BatchNorm's batch statistics: a real test
    assert not all(torch.equal(a, b) for a, b in zip(failed, unpieced, strict=True))


def test_fewer_samples_than_pieces_still_count_each_sample_once() -> None:
    """--strategy cpu: 3 samples in 4 pieces: one empty piece, weighted 0."""
    x, y = _data(3)
    rt = paratrain.Runtime("cpu", oom="auto")
    model = nn.Linear(6, 3)
    ref = nn.Linear(6, 3)
    ref.load_state_dict(model.state_dict())
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rt.micro_batches.split = 4
    loss = rt.forward_backward(model, nn.functional.cross_entropy, x, y)
    expected = nn.functional.cross_entropy(ref(x), y)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert torch.allclose(model.weight.grad, ref.weight.grad, atol=1e-6)


class _BackwardOom(torch.autograd.Function):
    """Raises in the backward of pieces larger than ``limit`` samples."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, limit: int) -> torch.Tensor:
        ctx.too_big = len(x) > limit
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.too_big:
            raise torch.OutOfMemoryError("backward ran out")
        return grad, None


def test_backward_out_of_memory_and_batch_of_one() -> None:
    """--strategy cpu: a backward that runs out (the first of its step) is dropped and
    redone; at one sample per piece the run stops with one message."""
    x, y = _data(8)
    linear = nn.Linear(6, 3)
    ref = nn.Linear(6, 3)
    ref.load_state_dict(linear.state_dict())
    rt = paratrain.Runtime("cpu", oom="auto")
    model, _ = rt.setup(linear, torch.optim.SGD(linear.parameters(), lr=0.1))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(_BackwardOom.apply(out, 2), target)

    rt.forward_backward(model, loss_fn, x, y)
    assert rt.micro_batches.split == 4
    nn.functional.cross_entropy(ref(x), y).backward()
    assert torch.allclose(linear.weight.grad, ref.weight.grad, atol=1e-6)

    def never_fits(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(_BackwardOom.apply(out, 0), target)

    linear.zero_grad()
    with pytest.raises(OutOfMemoryStop, match="one sample per process: nothing left to halve"):
        rt.forward_backward(model, never_fits, x, y)


def test_bad_oom_mode_is_refused() -> None:
    with pytest.raises(paratrain.UserError, match="--oom 'sometimes': use one of auto, off"):
        paratrain.Runtime("cpu", oom="sometimes")


def _oom_then_reference(rt: paratrain.Runtime, out: str, hook: str) -> dict[str, Any]:
    """In every process: digits for 5 steps of 64 with ``hook`` (running out from step 3),
    then the same run in two pieces per micro-batch from the start; rank 0's figures."""
    # the runtime's devices (cpu,cpu): left out, they would mean a GPU per process where
    # there are GPUs, and a machine with one has no cuda:1
    devices = ",".join(str(device) for device in rt.strategy.devices)
    cfg = TrainConfig(
        recipe="digits", strategy=rt.strategy.name, devices=devices, epochs=1, batch_size=64
    )
    cfg = dataclasses.replace(cfg.resolved(get_recipe), max_steps=5, progress=False)
    runs = {}
    for name, split in (("oom", 1), ("ref", 2)):
        os.environ[OOM_VARIABLE] = hook if name == "oom" else ""
        rt.micro_batches = MicroBatches("auto")
        rt.micro_batches.split = split
        seed_everything(cfg.seed)
        directory = Path(out) / name
        directory.mkdir(parents=True, exist_ok=True)
        runs[name] = train(rt, cfg, directory)
    first = load_file(str(Path(out) / "oom" / "model.safetensors"))
    second = load_file(str(Path(out) / "ref" / "model.safetensors"))
    state = json.loads((Path(out) / "oom/checkpoints/step-000005/state.json").read_text())
    return {
        "difference": max((first[k] - second[k]).abs().max().item() for k in first),
        "split": runs["oom"].micro_batch_split,
        "halved_at": runs["oom"].halved_at_step,
        "saved_split": state["micro_batch_split"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_one_runs_out_at_step_3(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], strategy: str
) -> None:
    """--strategy ddp / fsdp on cpu,cpu: rank 1 alone runs out above 16 samples per process
    from step 3 on; every process redoes the step in halves (no hang), and the run ends within
    1e-6 of one that used pieces of 16 from the start; the pieces are in its checkpoint and
    summary, said once."""
    rt = paratrain.Runtime(strategy, devices="cpu,cpu", oom="auto")
    result = rt.launch(_oom_then_reference, str(tmp_path), "1:16:3")
    assert result is not None
    assert result["difference"] <= 1e-6
    assert result["split"] == 2 and result["halved_at"] == 3 and result["saved_split"] == 2
    err = capfd.readouterr().err
    assert err.count("out of memory on rank(s) 1 at step 3 with 32 samples per process") == 1
    print(f"\n{strategy} x2, out of memory at step 3: weights {result['difference']:.3g} apart")


def _digits(name: str, tmp_path: Path, batch: int, accumulate: int = 1, **more: Any) -> Any:
    """`paratrain train --recipe digits --strategy cpu` for 5 steps, in this process."""
    rt = paratrain.Runtime("cpu", accumulate=accumulate, oom="auto", seed=0)
    cfg = TrainConfig(recipe="digits", strategy="cpu", epochs=1, batch_size=batch)
    cfg = dataclasses.replace(
        cfg.resolved(get_recipe), accumulate=accumulate, max_steps=5, progress=False
    )
    cfg = dataclasses.replace(cfg, **more)
    (tmp_path / name).mkdir(exist_ok=True)
    return train(rt, cfg, tmp_path / name)


def _max_difference(tmp_path: Path, a: str, b: str) -> float:
    first = load_file(str(tmp_path / a / "model.safetensors"))
    second = load_file(str(tmp_path / b / "model.safetensors"))
    return max((first[k] - second[k]).abs().max().item() for k in first)


@pytest.mark.slow
def test_train_runs_out_and_resumes_in_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """--strategy cpu, the loop of `paratrain train`: running out at step 1 gives the weights
    of batches of 32 with --accumulate 2 bit for bit (the same pieces, summed in the same
    order); the summary says it, the checkpoint remembers it, a resumed run goes on in
    pieces."""
    monkeypatch.setenv(OOM_VARIABLE, "0:32")
    summary = _digits("oom", tmp_path, 64)
    assert capfd.readouterr().err.count("out of memory on rank(s) 0 at step 1") == 1
    assert "ran out of memory at step 1: micro-batches run in 2 pieces of about 32" in (
        summary.line(None)
    )
    monkeypatch.delenv(OOM_VARIABLE)
    _digits("ref", tmp_path, 32, accumulate=2)
    assert _max_difference(tmp_path, "oom", "ref") == 0.0
    checkpoint = tmp_path / "oom/checkpoints/step-000005"
    assert json.loads((checkpoint / "state.json").read_text())["micro_batch_split"] == 2
    resumed = _digits("oom", tmp_path, 64, max_steps=6, resume_from=str(checkpoint))
    assert resumed.steps == 6 and resumed.micro_batch_split == 2
    config = json.loads((tmp_path / "oom/config.json").read_text())
    assert config["summary"]["micro_batch_split"] == 2
