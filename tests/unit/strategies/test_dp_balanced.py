"""dp-balanced: the balanced DataParallel, exercised on repeated CPU devices."""

from __future__ import annotations

import copy
import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.cli import main as cli
from paratrain.strategies.dp_balanced import PerDeviceOutputs
from paratrain.utils.errors import UserError


def _train_digits(out: Path, *strategy: str) -> dict[str, torch.Tensor]:
    argv = ["train", "--recipe", "digits", *strategy, "--max-steps", "50", "--no-progress"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
def test_digits_weights_match_cpu_after_50_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = _train_digits(tmp_path / "cpu", "--strategy", "cpu")
    for devices in ("cpu,cpu", "cpu,cpu,cpu"):
        out = tmp_path / devices.replace(",", "-")
        weights = _train_digits(out, "--strategy", "dp-balanced", "--devices", devices)
        assert weights.keys() == reference.keys()  # plain names, no "module." prefix
        diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
        with capsys.disabled():
            print(f"\ndigits, 50 steps, fp32: max |dp-balanced {devices} - cpu| = {diff:.2e}")
        assert diff < 1e-5


class DictModel(nn.Module):
    """Takes keyword arguments, returns a dict: what a user's model may look like."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, bias: float = 0.0) -> Any:
        features = torch.relu(self.body(x)) * scale
        return {"logits": self.head(features) + bias, "features": features}


def dict_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["logits"], y) + 0.1 * out["features"].pow(2).mean()


def _dict_data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(53, 6, generator=g),
        torch.rand(53, 1, generator=g) + 0.5,
        torch.randint(0, 3, (53,), generator=g),
    )


def _user_loop(strategy: str, devices: str | None) -> tuple[nn.Module, paratrain.Runtime]:
    rt = paratrain.Runtime(strategy=strategy, devices=devices, seed=7)
    model = DictModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    wrapped, optimizer, loss_fn = rt.setup(model, optimizer, dict_loss)
    loader = rt.setup_loader(DataLoader(_dict_data(), batch_size=10, shuffle=True))
    for _ in range(2):  # 53 samples: the last batch of each epoch has 3 samples
        for x, scale, y in loader:
            loss = loss_fn(wrapped(x, scale=scale, bias=0.5), y)
            rt.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return model, rt


@pytest.mark.slow
def test_user_loop_with_dict_outputs_and_kwargs_matches_cpu() -> None:
    reference, _ = _user_loop("cpu", None)
    model, rt = _user_loop("dp-balanced", "cpu,cpu,cpu")
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
    # The last step's batch had 3 samples, one per device: three float32 losses travelled.
    assert rt.strategy.gathered_bytes_per_step() == 3 * 4  # type: ignore[attr-defined]


def test_outputs_are_per_device_and_gather_to_the_whole_batch() -> None:
    rt = paratrain.Runtime(strategy="dp-balanced", devices="cpu,cpu,cpu", seed=0)
    model = DictModel()
    reference = copy.deepcopy(model)
    wrapped, _ = rt.setup(model, loss_fn=dict_loss)
    x, scale, _ = _dict_data().tensors
    out = wrapped(x[:7], scale=scale[:7])
    assert isinstance(out, PerDeviceOutputs) and out.sizes == [3, 2, 2]
    full = reference(x[:7], scale=scale[:7])
    gathered = out.gather()
    assert torch.allclose(gathered["logits"], full["logits"], atol=1e-6)
    assert torch.allclose(gathered["features"], full["features"], atol=1e-6)
    # Gathering the outputs is counted: 7 x (3 + 8) float32 values.
    assert rt.strategy.gathered_bytes_per_step() == 7 * 11 * 4  # type: ignore[attr-defined]


@pytest.mark.parametrize("rows", [2, 7, 9])
def test_loss_equals_whole_batch_loss_for_uneven_and_short_batches(rows: int) -> None:
    rt = paratrain.Runtime(strategy="dp-balanced", devices="cpu,cpu,cpu", seed=0)
    model = nn.Linear(5, 4)
    reference = copy.deepcopy(model)
    wrapped, loss_fn = rt.setup(model, loss_fn=nn.CrossEntropyLoss())
    x, y = torch.randn(rows, 5), torch.randint(0, 4, (rows,))
    out = wrapped(x)
    assert len(out.parts) == min(rows, 3)  # a batch of 2 uses two devices
    loss = loss_fn(out, y)
    expected = F.cross_entropy(reference(x), y)
    assert torch.allclose(loss, expected, atol=1e-6)
    loss.backward()
    expected.backward()
    assert reference.weight.grad is not None and model.weight.grad is not None
    assert torch.allclose(model.weight.grad, reference.weight.grad, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_sum_and_none_reductions(reduction: str) -> None:
    rt = paratrain.Runtime(strategy="dp-balanced", devices="cpu,cpu", seed=0)
    model = nn.Linear(3, 2)
    wrapped, loss_fn = rt.setup(model, loss_fn=nn.CrossEntropyLoss(reduction=reduction))
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    expected = F.cross_entropy(model(x), y, reduction=reduction)
    assert torch.allclose(loss_fn(wrapped(x), y), expected, atol=1e-6)


def test_tuple_outputs_and_several_targets() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x)

    def two_losses(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor, t: torch.Tensor):
        return F.cross_entropy(out[0], y) + F.mse_loss(out[1], t)

    model = TwoHeads()
    wrapped, loss_fn = paratrain.Runtime("dp-balanced", "cpu,cpu,cpu", seed=0).setup(
        model, loss_fn=two_losses
    )
    x, y, t = torch.randn(8, 3), torch.randint(0, 2, (8,)), torch.randn(8, 1)
    out = wrapped(x)
    assert all(isinstance(part, tuple) and len(part) == 2 for part in out.parts)
    assert torch.allclose(loss_fn(out, y, t), two_losses(model(x), y, t), atol=1e-6)


def test_autocast_is_reentered_in_every_forward_and_loss_thread() -> None:
    seen: list[tuple[str, int, bool, torch.dtype, torch.dtype]] = []

    def record(where: str, tensor: torch.Tensor) -> None:
        seen.append(
            (
                where,
                threading.get_ident(),
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
                tensor.dtype,
            )
        )

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.fc(x)
            record("forward", out)
            return out

    def probe_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        record("loss", out)
        return F.mse_loss(out, y)

    rt = paratrain.Runtime(strategy="dp-balanced", devices="cpu,cpu", precision="bf16", seed=0)
    model, loss_fn = rt.setup(Probe(), loss_fn=probe_loss)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with rt.autocast():
        loss_fn(model(x), y)
    forward = [s for s in seen if s[0] == "forward"]
    losses = [s for s in seen if s[0] == "loss"]
    main = threading.get_ident()
    assert len(forward) == 2 and len(losses) == 2
    assert all(s[1] != main for s in seen)  # the work ran in worker threads
    assert all(s[2] and s[3] == torch.bfloat16 for s in seen)
    assert all(s[4] == torch.bfloat16 for s in forward)
    assert all(s[4] == torch.float32 for s in losses)  # outputs leave autocast as float32

    # Outside rt.autocast() the loss runs in float32, as in a single-device loop.
    seen.clear()
    loss_fn(model(x), y)
    assert [s[2] for s in seen if s[0] == "forward"] == [True, True]
    assert [s[2] for s in seen if s[0] == "loss"] == [False, False]


def test_worker_exception_names_the_device() -> None:
    class FailsOnShortParts(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if len(x) < 3:
                raise ValueError("part too short")
            return super().forward(x)

    rt = paratrain.Runtime(strategy="dp-balanced", devices="cpu,cpu", seed=0)
    model, _ = rt.setup(FailsOnShortParts(2, 2), loss_fn=nn.MSELoss())
    with pytest.raises(ValueError, match=r"part too short \(on cpu, part 2 of 2\)"):
        model(torch.randn(5, 2))


def test_batchnorm_normalizes_per_part_and_keeps_first_part_running_stats() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    rt = paratrain.Runtime(strategy="dp-balanced", devices="cpu,cpu", seed=0)
    wrapped, loss_fn = rt.setup(model, loss_fn=nn.MSELoss())
    x, y = torch.randn(10, 4), torch.randn(10, 1)
    loss_fn(wrapped(x), y).backward()
    # Reference: each half normalized on its own; the loss is the mean over both halves.
    expected = (F.mse_loss(first(x[:5]), y[:5]) + F.mse_loss(second(x[5:]), y[5:])) / 2
    expected.backward()
    bn, bn_first = model[1], first[1]
    assert isinstance(bn, nn.BatchNorm1d) and isinstance(bn_first, nn.BatchNorm1d)
    assert torch.equal(bn.running_mean, bn_first.running_mean)
    assert torch.equal(bn.running_var, bn_first.running_var)
    assert int(bn.num_batches_tracked) == 1  # one step, counted once
    for p, a, b in zip(model.parameters(), first.parameters(), second.parameters(), strict=True):
        assert p.grad is not None and a.grad is not None and b.grad is not None
        assert torch.allclose(p.grad, a.grad + b.grad, atol=1e-6)


def test_setup_without_a_loss_function_is_refused() -> None:
    rt = paratrain.Runtime(strategy="dp-balanced", devices="cpu,cpu", seed=0)
    with pytest.raises(UserError, match="loss function"):
        rt.setup(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "0"], "at least 1"),
        (["--devices", "-2"], "at least 1"),
        (["--devices", "cpu,cuda:0"], "all of one kind"),
        (["--devices", "mps,mps"], "all of one kind"),
        (["--devices", "cuda:97"], "cuda:97"),
        (["--devices", "cpu,cpu,cpu", "--batch-size", "2"], "smaller than the number of devices"),
    ],
)
def test_bad_devices_exit_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    argv = ["train", "--strategy", "dp-balanced", *args, "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratrain: error:") and message in err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_without_cuda_the_default_devices_point_to_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["train", "--strategy", "dp-balanced", "--out", str(tmp_path)]) == 2
    assert "--devices cpu,cpu" in capsys.readouterr().err


@dataclasses.dataclass
class _Output:
    """What a Hugging Face model returns (a ``ModelOutput`` is a dataclass and a dict)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class _LabelsModel(nn.Module):
    """The Hugging Face idiom: ``model(x, labels=y).loss``, no loss function of one's own."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> _Output:
        logits = self.head(torch.relu(self.body(x)))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return _Output(loss, logits)


def _labels_loop(strategy: str, devices: str | None) -> tuple[nn.Module, torch.Tensor]:
    rt = paratrain.Runtime(strategy=strategy, devices=devices, seed=7)
    model = _LabelsModel()
    wrapped, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
    x, _, y = _dict_data().tensors
    loader = rt.setup_loader(DataLoader(TensorDataset(x, y), batch_size=10))
    for _ in range(2):  # 53 samples: a last batch of 3, one per device
        for inputs, labels in loader:
            rt.backward(wrapped(inputs, labels=labels).loss)
            optimizer.step()
            optimizer.zero_grad()
    return model, wrapped(x).logits


def test_a_model_that_computes_its_own_loss_needs_no_loss_function() -> None:
    """dp-balanced on cpu,cpu,cpu: ``model(x, labels=y).loss`` is the whole batch's loss (each
    device's weighted by its samples), ``.logits`` the whole batch's; the weights match one
    process. A field the output lacks is named in one line."""
    reference, reference_logits = _labels_loop("cpu", None)
    model, logits = _labels_loop("dp-balanced", "cpu,cpu,cpu")
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
    assert torch.allclose(logits, reference_logits, atol=1e-6)
    rt = paratrain.Runtime(strategy="dp-balanced", devices="cpu,cpu", seed=0)
    wrapped = rt.setup(_LabelsModel())  # no loss function: its forward takes labels
    outputs = wrapped(torch.randn(4, 6))
    assert isinstance(outputs, PerDeviceOutputs)
    with pytest.raises(AttributeError, match="has no field 'hidden_states' under dp-balanced"):
        _ = outputs.hidden_states
