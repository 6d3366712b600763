"""What is trained while measuring: a built-in recipe, or the user's own model from a script.

The script contract (``--script path/to/file.py:factory``): ``factory()`` takes no argument
and returns ``(model, loss_fn, sample_batch)`` or ``(model, loss_fn, sample_batch,
make_optimizer)``:

- ``model``: an ``nn.Module`` on the CPU (the runtime places it);
- ``loss_fn(outputs, targets)``: returns a scalar tensor;
- ``sample_batch(n)``: returns ``(inputs, targets)``, two CPU tensors of ``n`` rows each;
- ``make_optimizer(params)``: optional, default ``SGD(lr=0.01, momentum=0.9)``.

The bench draws two global batches from ``sample_batch`` and feeds them through
``Runtime.setup_loader``, so every layout splits the same batches the same way.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from paratrain.utils.errors import UserError

#: global batches of synthetic data a script-defined model trains on (cycled)
SCRIPT_BATCHES = 2


@dataclass(frozen=True)
class TaskSource:
    """Where the model comes from; plain data, so it travels to worker processes."""

    recipe: str | None = None
    script: str | None = None
    data_dir: str | None = None
    synthetic: int | None = None
    seed: int = 0

    @property
    def name(self) -> str:
        if self.script is not None:
            return Path(self.script.rsplit(":", 1)[0]).stem
        return str(self.recipe)


@dataclass
class BenchTask:
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    make_optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
    dataset: Dataset[Any]
    default_batch_size: int


def load_task(source: TaskSource, batch_size: int | None = None) -> BenchTask:
    """Build the model, loss, optimizer factory and training data of ``source``."""
    if source.script is not None:
        return _load_script(source.script, batch_size or 32)
    return _load_recipe(source)


def _load_recipe(source: TaskSource) -> BenchTask:
    from paratrain.training.config import TrainConfig
    from paratrain.training.recipes import get_recipe

    assert source.recipe is not None
    recipe = get_recipe(source.recipe)
    # The recipe's defaults and data checks, as `paratrain train` resolves them; the layout
    # is chosen per benchmarked combination, so any strategy will do here.
    cfg = TrainConfig(
        recipe=recipe.name,
        strategy="cpu",
        seed=source.seed,
        data_dir=source.data_dir,
        synthetic=source.synthetic,
    ).resolved(get_recipe)
    train_set, _ = recipe.build_data(cfg)
    return BenchTask(
        model=recipe.build_model(cfg),
        loss_fn=recipe.build_loss(),
        make_optimizer=lambda params: recipe.build_optimizer(params, cfg),
        dataset=train_set,
        default_batch_size=recipe.batch_size,
    )


def _default_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def import_factory(target: str) -> Callable[[], Any]:
    """``path/to/file.py:factory`` into the function, or ``UserError`` saying what is wrong."""
    path_text, sep, attr = target.rpartition(":")
    if not sep or not path_text or not attr:
        raise UserError(f"--script {target!r}: write it as path/to/file.py:factory")
    path = Path(path_text)
    if not path.is_file():
        raise UserError(f"--script {target!r}: no file {path}")
    module_name = f"paratrain_bench_script_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"--script {target!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    spec.loader.exec_module(module)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"--script {target!r}: {path} has no function {attr!r}")
    return factory


def _load_script(target: str, batch_size: int) -> BenchTask:
    built = import_factory(target)()
    if not isinstance(built, tuple) or len(built) not in (3, 4):
        raise UserError(
            f"--script {target}: the factory must return (model, loss_fn, sample_batch) "
            "or (model, loss_fn, sample_batch, make_optimizer)"
        )
    model, loss_fn, sample_batch = built[:3]
    make_optimizer = built[3] if len(built) == 4 else _default_optimizer
    if not isinstance(model, nn.Module):
        raise UserError(f"--script {target}: the factory's first item must be an nn.Module")
    if not callable(loss_fn) or not callable(sample_batch) or not callable(make_optimizer):
        raise UserError(
            f"--script {target}: loss_fn, sample_batch and make_optimizer must be functions"
        )
    inputs, targets = _sample(target, sample_batch, batch_size * SCRIPT_BATCHES)
    return BenchTask(
        model=model,
        loss_fn=loss_fn,
        make_optimizer=make_optimizer,
        dataset=TensorDataset(inputs, targets),
        default_batch_size=batch_size,
    )


def _sample(target: str, sample_batch: Callable[[int], Any], n: int) -> tuple[torch.Tensor, ...]:
    batch = sample_batch(n)
    if (
        not isinstance(batch, (tuple, list))
        or len(batch) != 2
        or not all(isinstance(t, torch.Tensor) and len(t) == n for t in batch)
    ):
        raise UserError(
            f"--script {target}: sample_batch({n}) must return (inputs, targets), "
            f"two tensors of {n} rows"
        )
    return batch[0].cpu(), batch[1].cpu()


def check_task(
    source: TaskSource, batch_sizes: list[int] | None
) -> tuple[int, list[int], nn.Module]:
    """Load ``source`` once here, so a broken recipe or script fails before any worker
    starts. Returns the number of training samples, the batch sizes to measure
    (``None``: the recipe's own, 32 for a script) and the model (layouts that refuse it are
    not started)."""
    task = load_task(source, max(batch_sizes) if batch_sizes else None)
    sizes = batch_sizes or [task.default_batch_size]
    size = len(task.dataset)  # type: ignore[arg-type]
    too_big = [b for b in sizes if b > size]
    if too_big:
        raise UserError(
            f"batch size {too_big[0]} is larger than the {size} training samples of "
            f"{source.name}; choose smaller --batch-sizes"
        )
    return size, sizes, task.model
