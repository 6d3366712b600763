"""A plain training loop ported as docs/porting.md says computes the same model.

`Runtime()` seeds nothing (the script's own `torch.manual_seed` stands) and its loaders draw
from the random generators exactly as torch's DataLoader does: the per-`iter()` base seed
and the RandomSampler permutation. Devices: `--strategy cpu` in this process; `ddp` on
`cpu,cpu` in two spawned processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.distributed.collective_order import CHECK_VARIABLE
from paratrain.utils.errors import LaunchError

SAMPLES, BATCH, EPOCHS = 44, 8, 2
pytestmark = pytest.mark.slow  # real processes, or several layers at work


TEST_SAMPLES = 21  # the last evaluation batch (5) splits unevenly


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(123)  # the data set is fixed, not the run's seed
    x = torch.randn(SAMPLES, 6, generator=generator)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def _model(dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 2))


def _original(seed: int, dropout: float, **loader_options: Any) -> dict[str, torch.Tensor]:
    """The script before porting: seeds, builds, trains, with plain torch."""
    torch.manual_seed(seed)
    model = _model(dropout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True, **loader_options)
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ported(
    rt: paratrain.Runtime, seed: int, dropout: float, data_path: str = "auto", **options: Any
) -> dict[str, torch.Tensor]:
    """The same script ported: the runtime places the model and the loader, nothing else."""
    torch.manual_seed(seed)
    if rt.rank == 1:
        torch.rand(3)  # an unseeded rank drifts: rank 0's permutation must still count
    model = _model(dropout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True, **options)
    loader = rt.setup_loader(loader, data_path=data_path)
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            rt.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
    inner = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("data_path", ["loader", "batched"])
def test_port_with_dropout_and_shuffle_is_bit_identical_on_cpu(data_path: str) -> None:
    """--strategy cpu: every dropout mask and every batch where the original had them."""
    original = _original(1, dropout=0.3)
    ported = _ported(paratrain.Runtime(strategy="cpu"), 1, 0.3, data_path)
    assert _equal(original, ported)
    assert not _equal(original, _original(5, dropout=0.3))  # the script's --seed matters


def test_a_loader_with_its_own_generator_stays_in_step() -> None:
    """--strategy cpu: DataLoader(generator=g) draws from g, as torch's does."""
    original = _original(2, 0.3, generator=torch.Generator().manual_seed(9))
    rt = paratrain.Runtime(strategy="cpu")
    ported = _ported(rt, 2, 0.3, generator=torch.Generator().manual_seed(9))
    assert _equal(original, ported)


def test_the_scripts_seed_wins_and_runtime_seeds_only_when_asked() -> None:
    """--strategy cpu: Runtime() leaves the generators alone; Runtime(seed=N) seeds them."""
    torch.manual_seed(1)
    expected = torch.rand(2)
    torch.manual_seed(1)
    paratrain.Runtime(strategy="cpu")
    assert torch.equal(torch.rand(2), expected)
    paratrain.Runtime(strategy="cpu", seed=1)
    assert torch.equal(torch.rand(2), expected)
    one = _ported(paratrain.Runtime(strategy="cpu"), 1, 0.3)
    five = _ported(paratrain.Runtime(strategy="cpu"), 5, 0.3)
    assert not _equal(one, five)


def _test_set() -> TensorDataset:
    x = torch.randn(TEST_SAMPLES, 6, generator=torch.Generator().manual_seed(321))
    return TensorDataset(x, (x[:, 0] > 0).long())


def _correct(model: nn.Module, loader: Any) -> int:
    """The original script's test(): a plain sum of correct predictions."""
    correct = 0
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(dim=1) == y).sum().item())
    return correct


def _ddp_port(rt: paratrain.Runtime, folder: str) -> None:
    """The port under ddp; its results go to a file, for it ends as a half-port does: with
    the original's rank guard kept around rt.save, which stops every process."""
    weights = _ported(rt, 3, dropout=0.0)
    model = _model(0.0)
    model.load_state_dict(weights)
    literal = rt.setup_loader(DataLoader(_test_set(), batch_size=BATCH))  # as training's
    rt.print("literal port:", _correct(model, literal))  # rank 0's part only: paratrain notes it
    loader = rt.setup_loader(DataLoader(_test_set(), batch_size=BATCH), evaluation=True)
    correct = rt.all_reduce(torch.tensor(_correct(model, loader))).item()
    rt.print("as the guide says:", correct)
    if rt.rank == 0:
        torch.save({"weights": weights, "correct": correct}, Path(folder) / "results.pt")
        rt.save(Path(folder) / "checkpoint.pt", {"model": model})  # only rank 0 reaches it


def test_ddp_on_two_processes_matches_the_original_without_dropout(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ddp on cpu,cpu: rank 0's permutation, split in two, is the original's batches; the
    evaluation ported as the guide says counts what one process counts, the literal port's
    partial count is announced before it is printed, and a save kept under `if rank == 0:`
    stops both processes with one message naming rt.save (within the check's time)."""
    original = _original(3, dropout=0.0)
    monkeypatch.setenv(CHECK_VARIABLE, "3")  # seconds: 50 by default
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu")
    with pytest.raises(LaunchError) as caught:
        rt.launch(_ddp_port, str(tmp_path))
    message = str(caught.value)
    assert "rank 0 has waited" in message and "in rt.save (collective #" in message
    assert "which rank 1 did not reach: rank 1 has finished" in message
    assert "Traceback" not in message and "gloo" not in message.lower()
    ported = torch.load(tmp_path / "results.pt")
    for key, value in original.items():
        torch.testing.assert_close(ported["weights"][key], value, rtol=0, atol=1e-6)
    model = _model(0.0)
    model.load_state_dict(original)
    assert ported["correct"] == _correct(model, DataLoader(_test_set(), batch_size=BATCH))
    err = capfd.readouterr().err
    assert err.count("a loader set up for training is iterated under torch.no_grad()") == 1
    assert "evaluation=True" in err
    assert err.count("rt.print after an evaluation loop with no rt.all_reduce since") == 1
