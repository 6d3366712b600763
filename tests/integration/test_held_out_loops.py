"""Loops written the way public scripts are written, ported as docs/porting.md says, none of
them shaped by paratrain's own recipes or docs: each trains the model one process trains,
resumes where it stopped, and reports the one-process evaluation figure.

* Accelerate's ``examples/by_feature/gradient_accumulation.py``: dict batches, a model that
  returns an output with ``.loss``, AdamW, a linear warm-up schedule stepped after every
  ``optimizer.step()`` call, ``accumulate(model)``, and ``gather_for_metrics`` (here
  ``rt.all_gather``) over an evaluation set whose last batch splits unevenly.
* Accelerate's ``examples/by_feature/checkpointing.py``: accumulation by hand (``loss /
  gradient_accumulation_steps``, ``if step % gradient_accumulation_steps == 0``), a save every
  k micro-batches that may fall inside a group, a resume that skips the batches done.
* pytorch/examples ``mnist/main.py``: ``train()`` and ``test()`` with per-batch ``.item()``
  sums, here combined with ``rt.all_reduce``, under pipeline as well.

Devices: ``cpu`` in this process; ``ddp`` and ``pipeline`` on ``cpu,cpu`` in two spawned
processes (gloo).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import paratrain

pytestmark = pytest.mark.slow  # real processes

Weights = dict[str, torch.Tensor]


def _weights(model: nn.Module) -> Weights:
    return {k.removeprefix("module."): v.detach().clone() for k, v in model.state_dict().items()}


def _largest_difference(a: Weights, b: Weights) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- Accelerate's gradient_accumulation.py ---------------------------------------------------
@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 2))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        logits = self.body(input_ids)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return Output(loss, logits)


class Pairs(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 12, generator=generator)
        self.y = (self.x[:, :3].sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def accumulation_script(rt: paratrain.Runtime) -> tuple[Weights, list[int]]:
    torch.manual_seed(42)
    train_dataloader = DataLoader(Pairs(103, 1), shuffle=True, batch_size=16)
    eval_dataloader = DataLoader(Pairs(37, 2), shuffle=False, batch_size=8)
    model = Classifier()
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=2e-2)
    num_epochs = 3
    total = len(train_dataloader) * num_epochs

    def warmup_then_linear(step: int) -> float:  # get_linear_schedule_with_warmup's shape
        return min(1.0, (step + 1) / 4) * max(0.0, (total - step) / total)

    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_linear)
    model, optimizer, lr_scheduler = rt.setup(model, optimizer, lr_scheduler)
    train_dataloader = rt.setup_loader(train_dataloader)
    eval_dataloader = rt.setup_loader(eval_dataloader, evaluation=True)
    counted = []
    for _epoch in range(num_epochs):
        model.train()
        for _step, batch in enumerate(train_dataloader):
            with rt.accumulate(model):
                output = model(**batch)
                loss = output.loss
                rt.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = seen = 0
        for _step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            # gather_for_metrics: the last batch is 3 samples on one process, 2 on the other
            gathered = torch.cat(rt.all_gather(predictions))
            references = torch.cat(rt.all_gather(batch["labels"]))
            correct += int((gathered == references).sum())
            seen += len(references)
        counted.append(seen)
        rt.print(f"epoch {_epoch}: {correct}/{seen}")
    return _weights(model), counted


def test_accelerates_accumulation_example_trains_the_one_process_model() -> None:
    """cpu here, ddp on cpu,cpu: within 1e-5, and every evaluation sample gathered once."""
    one, counted = paratrain.Runtime(strategy="cpu", accumulate=2, seed=0).launch(
        accumulation_script
    )
    two, counted_two = paratrain.Runtime(
        strategy="ddp", devices="cpu,cpu", accumulate=2, seed=0
    ).launch(accumulation_script)
    assert counted == counted_two == [37, 37, 37]
    assert _largest_difference(one, two) < 1e-5


# -- Accelerate's checkpointing.py -----------------------------------------------------------
GAS, CHECKPOINTING_STEPS, EPOCHS = 2, 4, 2


def checkpointing_script(
    rt: paratrain.Runtime, output_dir: str, resume_from_checkpoint: str | None, stop_at: int
) -> Weights | None:
    torch.manual_seed(42)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(70, 12, generator=generator)
    train_dataloader = DataLoader(
        TensorDataset(x, (x[:, :3].sum(1) > 0).long()), shuffle=True, batch_size=8
    )
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=2e-2)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    model, optimizer, lr_scheduler = rt.setup(model, optimizer, lr_scheduler)
    loader = rt.setup_loader(train_dataloader)
    parts = {"model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler}
    overall_step, starting_epoch, resume_step = 0, 0, 0
    if resume_from_checkpoint:
        rt.load(resume_from_checkpoint, parts)
        training_difference = os.path.splitext(os.path.basename(resume_from_checkpoint))[0]
        resume_step = int(training_difference.replace("step_", ""))
        overall_step = resume_step
        starting_epoch = resume_step // len(loader)
        resume_step -= starting_epoch * len(loader)
    for epoch in range(starting_epoch, EPOCHS):
        model.train()
        first = resume_step if epoch == starting_epoch else 0
        loader.set_epoch(epoch, start_batch=first)  # accelerator.skip_first_batches
        for step, (inputs, labels) in enumerate(loader, start=first):
            loss = F.cross_entropy(model(inputs), labels)
            loss = loss / GAS
            rt.backward(loss)
            if step % GAS == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            overall_step += 1
            if overall_step % CHECKPOINTING_STEPS == 0:
                rt.save(os.path.join(output_dir, f"step_{overall_step}.pt"), parts)
            if overall_step == stop_at:
                return None  # killed here
    return _weights(model)


@pytest.mark.parametrize("layout", ["cpu", "ddp"])
def test_accelerates_checkpointing_example_resumes_inside_a_hand_made_group(
    layout: str, tmp_path: Path
) -> None:
    """cpu here, ddp on cpu,cpu: the save at micro-batch 8 falls between the backwards of a
    pair (the step at 7 stepped, 8 did not): the resumed run ends where the whole one does."""
    devices = "cpu" if layout == "cpu" else "cpu,cpu"

    def run(resume: str | None, stop_at: int = -1) -> Any:
        rt = paratrain.Runtime(strategy=layout, devices=devices, seed=0)
        return rt.launch(checkpointing_script, str(tmp_path), resume, stop_at)

    whole = run(None)
    run(None, stop_at=10)
    resumed = run(str(tmp_path / "step_8.pt"))
    assert _largest_difference(whole, resumed) < 1e-6


# -- pytorch/examples mnist/main.py ------------------------------------------------------------
def _digits_like(n: int, seed: int) -> TensorDataset:
    x = torch.randn(n, 20, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long())


def train(rt: paratrain.Runtime, model: nn.Module, train_loader: Any, optimizer: Any) -> None:
    model.train()
    for _batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        rt.forward_backward(model, F.nll_loss, data, target)  # pipeline's form, every layout
        optimizer.step()


def test(rt: paratrain.Runtime, model: nn.Module, test_loader: Any) -> tuple[float, int]:
    model.eval()
    test_loss = 0.0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    totals = rt.all_reduce(torch.tensor([test_loss, correct], dtype=torch.float64))
    test_loss = totals[0].item() / len(test_loader.dataset)
    rt.print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {int(totals[1])}")
    return test_loss, int(totals[1])


test.__test__ = False  # type: ignore[attr-defined]  # the script's name, not a test


def mnist_script(rt: paratrain.Runtime) -> list[tuple[float, int]]:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)
    )
    model.append(nn.LogSoftmax(dim=1))
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    model, optimizer, scheduler = rt.setup(model, optimizer, scheduler)
    train_loader = rt.setup_loader(DataLoader(_digits_like(96, 1), batch_size=16, shuffle=True))
    test_loader = rt.setup_loader(DataLoader(_digits_like(53, 2), batch_size=10), evaluation=True)
    results = []
    for _epoch in range(1, 3):
        train(rt, model, train_loader, optimizer)
        results.append(test(rt, model, test_loader))
        scheduler.step()
    return results


@pytest.mark.parametrize("layout", ["ddp", "pipeline"])
def test_mnists_test_function_reports_the_one_process_figures(layout: str) -> None:
    """cpu here; ddp and pipeline on cpu,cpu: the same average loss and accuracy."""
    one = paratrain.Runtime(strategy="cpu", seed=0).launch(mnist_script)
    two = paratrain.Runtime(strategy=layout, devices="cpu,cpu", seed=0).launch(mnist_script)
    assert [correct for _, correct in two] == [correct for _, correct in one]
    assert all(abs(a - b) < 1e-5 for (a, _), (b, _) in zip(one, two, strict=True))
