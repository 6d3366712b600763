"""The same model and the same evaluation figures on every layout, where a layout used to
differ: a last batch smaller than the number of processes (1 sample for 2), and the
evaluation code of docs/porting.md under ``pipeline`` (whose stages share one batch).

A user's loop (``rt.setup_loader``, ``rt.forward_backward``, the documented evaluation) on
103 samples in global batches of 17 for 3 epochs: each epoch ends with a batch of 1 sample.
``ddp`` and ``pipeline`` on ``cpu,cpu`` must end with one process's weights and count the
203 test samples once each, with one process's accuracy; ``paratrain train`` on ddp trains
the same last batch and reports one process's training loss.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import CLI
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

pytestmark = pytest.mark.slow  # real processes

TOLERANCE = 1e-5
SAMPLES, BATCH, EPOCHS, TEST_SAMPLES = 103, 17, 3, 203


def _data(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator)
    )


def _train_and_evaluate(rt: paratrain.Runtime, weights: str) -> dict[str, Any]:
    """Train, then evaluate as docs/porting.md does; the counts as every process sees them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    loader = rt.setup_loader(DataLoader(_data(SAMPLES, 1), batch_size=BATCH, shuffle=True))
    test_data = _data(TEST_SAMPLES, 2)
    test_loader = rt.setup_loader(DataLoader(test_data, batch_size=50), evaluation=True)
    batches = 0
    for _ in range(EPOCHS):
        model.train()
        for x, y in loader:
            rt.forward_backward(model, nn.functional.cross_entropy, x, y)
            optimizer.step()
            optimizer.zero_grad()
            batches += 1
    model.eval()
    correct = torch.zeros((), device=rt.device)
    seen = torch.zeros((), device=rt.device)
    with torch.no_grad():
        for x, y in test_loader:
            correct += (model(x).argmax(dim=1) == y).sum()
            seen += len(y)
    correct = rt.all_reduce(correct)
    seen = rt.all_reduce(seen)
    rt.save_weights(model, weights)
    return {"batches": batches, "correct": correct.item(), "seen": seen.item()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("cpu") / "weights.safetensors"
    result = _train_and_evaluate(paratrain.Runtime(strategy="cpu", seed=0), str(path))
    return {**result, "weights": load_file(str(path))}


@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_last_batch_and_documented_evaluation_match_one_process(
    strategy: str, one_process: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "weights.safetensors"
    rt = paratrain.Runtime(strategy=strategy, devices="cpu,cpu", seed=0)
    result = rt.launch(_train_and_evaluate, str(path))
    assert result is not None
    # the 1-sample last batch of each epoch is trained on, not dropped
    assert result["batches"] == one_process["batches"] == EPOCHS * 7
    weights = load_file(str(path))
    reference = one_process["weights"]
    diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
    assert diff < TOLERANCE, f"{strategy} vs cpu after {EPOCHS} epochs: {diff:.3g}"
    # every test sample counted once (pipeline: not once per stage), one process's accuracy
    assert result["seen"] == one_process["seen"] == TEST_SAMPLES
    assert result["correct"] == one_process["correct"]


def _train_digits(
    cli: CLI, out: Path, *layout: str
) -> tuple[dict[str, torch.Tensor], list[float], str]:
    """``paratrain train --recipe digits`` in global batches of 359: 1437 training samples
    leave a last batch of 1 each epoch."""
    result = cli(
        "train", "--recipe", "digits", "--batch-size", "359", "--epochs", "2",
        "--no-progress", "--out", str(out), *layout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("split") == "train"]
    return load_file(str(out / "model.safetensors")), losses, result.stdout


def test_paratrain_train_trains_a_last_batch_of_one_sample_on_two_processes(
    tmp_path: Path, paratrain_here: CLI
) -> None:
    cpu = _train_digits(paratrain_here, tmp_path / "cpu", "--strategy", "cpu")
    reference, reference_losses, _ = cpu
    weights, losses, stdout = _train_digits(
        paratrain_here, tmp_path / "ddp", "--strategy", "ddp", "--devices", "cpu,cpu"
    )
    assert "trained 2 epochs, 10 steps" in stdout  # 4 full batches and the last, twice
    diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
    assert diff < TOLERANCE
    # the process with no sample of the last batch trains on a stand-in that counts nothing
    assert losses == pytest.approx(reference_losses, rel=1e-6)
