"""The training configuration: a plain dataclass, checked before any process starts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from paratrain.errors import UserError
from paratrain.precision import normalize_precision
from paratrain.runtime import RuntimeConfig
from paratrain.strategies import StrategyOptions, build_strategy, check_sync_batchnorm

DEFAULT_RECIPE = "digits"


class RecipeDefaults(Protocol):
    """What resolving a configuration needs to know of its recipe."""

    @property
    def epochs(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def lr(self) -> float: ...

    def check_data_options(self, data_dir: str | None, synthetic: int | None) -> None: ...

    @property
    def build_model(self) -> Callable[[Any], nn.Module]: ...


#: looks a recipe up by name, or raises ``UserError`` (``paratrain.recipes.get_recipe``)
RecipeLookup = Callable[[str], RecipeDefaults]


@dataclass
class TrainConfig:
    recipe: str = DEFAULT_RECIPE
    strategy: str = "auto"
    devices: str | None = None
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    out: str | None = None
    overwrite: bool = False
    data_dir: str | None = None
    synthetic: int | None = None
    precision: str = "32"
    accumulate: int = 1
    sync_batchnorm: bool = False
    #: deterministic algorithms and no TF32: the same seed gives the same weights on a GPU
    deterministic: bool = False
    cifar_stem: bool = False
    max_steps: int | None = None
    progress: bool = True
    #: also checkpoint every N optimizer steps (always at the end of every epoch)
    save_every: int | None = None
    #: how many of the newest checkpoints to keep
    keep: int = 3
    #: the checkpoint directory this run continues from (set by ``--resume``)
    resume_from: str | None = None
    #: fsdp: comma-separated class or module names of the blocks sharded as one unit each
    fsdp_blocks: str | None = None

    def resolved(self, recipes: RecipeLookup) -> TrainConfig:
        """A copy with the recipe's defaults filled in, or ``UserError`` naming what is wrong.

        ``recipes`` finds the recipe by name (``paratrain.recipes.get_recipe``). Builds the
        strategy once to check strategy, devices and batch arithmetic here, before any
        process or process group exists.
        """
        recipe = recipes(self.recipe)
        cfg = dataclasses.replace(
            self,
            epochs=recipe.epochs if self.epochs is None else self.epochs,
            batch_size=recipe.batch_size if self.batch_size is None else self.batch_size,
            lr=recipe.lr if self.lr is None else self.lr,
            precision=normalize_precision(self.precision),
        )
        _positive("--epochs", cfg.epochs)
        _positive("--batch-size", cfg.batch_size)
        _positive("--accumulate", cfg.accumulate)
        if cfg.max_steps is not None:
            _positive("--max-steps", cfg.max_steps)
        if cfg.save_every is not None:
            _positive("--save-every", cfg.save_every)
        _positive("--keep", cfg.keep)
        if cfg.synthetic is not None:
            _positive("--synthetic", cfg.synthetic)
        if cfg.lr is None or not cfg.lr > 0:
            raise UserError(f"--lr must be a positive number, got {cfg.lr}")
        recipe.check_data_options(cfg.data_dir, cfg.synthetic)
        strategy = build_strategy(cfg.strategy, cfg.devices, cfg.runtime_config().options)
        check_sync_batchnorm(strategy, cfg.sync_batchnorm)
        if strategy.checks_model:  # e.g. fsdp on a model without parameters
            strategy.check_model(recipe.build_model(cfg))
        assert cfg.batch_size is not None
        if cfg.batch_size < len(strategy.devices):
            raise UserError(
                f"--batch-size {cfg.batch_size} is smaller than the number of devices "
                f"({len(strategy.devices)}); every device needs at least one sample"
            )
        return cfg

    def runtime_config(self) -> RuntimeConfig:
        return RuntimeConfig(
            strategy=self.strategy,
            devices=self.devices,
            precision=self.precision,
            seed=self.seed,
            accumulate=self.accumulate,
            sync_batchnorm=self.sync_batchnorm,
            deterministic=self.deterministic,
            options=StrategyOptions(normalize_precision(self.precision), self.block_names()),
        )

    def block_names(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in (self.fsdp_blocks or "").split(",") if n.strip())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(flag: str, value: int | None) -> None:
    if value is None or value < 1:
        raise UserError(f"{flag} must be at least 1, got {value}")
