"""The training configuration: a plain dataclass, checked before any process starts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from paratrain.runtime.batching import check_batch_size_per
from paratrain.utils.errors import UserError

if TYPE_CHECKING:  # the command line builds its parsers from TrainConfig without torch
    from torch import nn

    from paratrain.runtime.facade import RuntimeConfig
    from paratrain.runtime.speed import SpeedOptions

DEFAULT_RECIPE = "digits"


class RecipeDefaults(Protocol):
    """What resolving a configuration needs to know of its recipe."""

    @property
    def epochs(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def lr(self) -> float: ...

    def check_data_options(
        self, data_dir: str | None, synthetic: int | None, download: bool = False
    ) -> None: ...

    @property
    def build_model(self) -> Callable[[Any], nn.Module]: ...


#: looks a recipe up by name, or raises ``UserError`` (``paratrain.training.recipes.get_recipe``)
RecipeLookup = Callable[[str], RecipeDefaults]


@dataclass
class TrainConfig:
    recipe: str = DEFAULT_RECIPE
    strategy: str = "auto"
    devices: str | None = None
    epochs: int | None = None
    batch_size: int | None = None
    #: what --batch-size means: "global" (every layout the same) or "process"
    #: (paratrain.runtime.batching)
    batch_size_per: str = "global"
    lr: float | None = None
    seed: int = 0
    out: str | None = None
    overwrite: bool = False
    data_dir: str | None = None
    synthetic: int | None = None
    #: fetch the recipe's data (CIFAR-10) into data_dir, or the cache, before training
    download: bool = False
    #: log metrics for TensorBoard into RUN/tensorboard/
    tensorboard: bool = False
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
    #: how batches are made: auto, loader, batched or device (paratrain.data.paths)
    data_path: str = "auto"
    #: GiB of data the device path may copy to each device (default: a share of its free memory)
    device_budget_gib: float | None = None
    #: torch.compile: None (off), "auto" (--compile) or a mode (--compile MODE)
    compile: str | None = None
    #: None: automatic (a model with Conv2d on CUDA); --channels-last / --no-channels-last
    channels_last: bool | None = None
    #: fsdp: comma-separated class or module names of the blocks sharded as one unit each
    fsdp_blocks: str | None = None
    #: pipeline: comma-separated names of the modules that start stages 2, 3, ...
    pipeline_split: str | None = None
    #: pipeline: "1f1b" or "gpipe"
    pipeline_schedule: str = "1f1b"
    #: pipeline: micro-batches per batch
    pipeline_microbatches: int = 4
    #: intra-op threads of each process; None: chosen (paratrain.launching.threads)
    threads: int | None = None
    #: "auto": a micro-batch that runs out of memory is redone in smaller pieces
    #: (paratrain.runtime.oom)
    oom: str = "auto"
    #: a torch profiler trace of this many steps into RUN/profile/
    profile: int | None = None
    #: log params, metrics and the final weights to this MLflow tracking URI or folder
    mlflow: str | None = None
    #: each block recomputes its activations in the backward: less memory, more time
    activation_checkpointing: bool = False

    def resolved(self, recipes: RecipeLookup) -> TrainConfig:
        """A copy with the recipe's defaults filled in, or ``UserError`` naming what is wrong.

        ``recipes`` finds the recipe by name (``paratrain.training.recipes.get_recipe``). Builds the
        strategy once to check strategy, devices and batch arithmetic here, before any
        process or process group exists.
        """
        from paratrain.data.paths import check_data_path
        from paratrain.devices.precision import normalize_precision
        from paratrain.runtime.oom import check_oom_mode
        from paratrain.runtime.speed import check_speed
        from paratrain.strategies import build_strategy, check_sync_batchnorm

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
        if cfg.threads is not None:
            _positive("--threads", cfg.threads)
        if cfg.profile is not None:
            _positive("--profile", cfg.profile)
        _positive("--keep", cfg.keep)
        check_oom_mode(cfg.oom)
        if cfg.synthetic is not None:
            _positive("--synthetic", cfg.synthetic)
        if cfg.lr is None or not (cfg.lr > 0 and math.isfinite(cfg.lr)):
            raise UserError(f"--lr must be a positive number, got {cfg.lr}")
        if not 0 <= cfg.seed < 2**63:
            raise UserError(f"--seed must be between 0 and 2**63-1, got {cfg.seed}")
        recipe.check_data_options(cfg.data_dir, cfg.synthetic, cfg.download)
        strategy = build_strategy(cfg.strategy, cfg.devices, cfg.runtime_config().options)
        check_sync_batchnorm(strategy, cfg.sync_batchnorm)
        _check_strategy_options(cfg, strategy.name)
        check_data_path(cfg.data_path, cfg.device_budget_gib, strategy.devices[0])
        check_speed(strategy, cfg.speed_options())
        if strategy.checks_model:  # e.g. fsdp on a model without parameters
            import torch

            with torch.device("meta"):  # shapes are enough: nothing is allocated
                strategy.check_model(recipe.build_model(cfg))
        assert cfg.batch_size is not None
        check_batch_size_per(cfg.batch_size_per)
        per_process = cfg.batch_size_per == "process"
        if cfg.batch_size * (strategy.num_processes if per_process else 1) < len(strategy.devices):
            raise UserError(
                f"--batch-size {cfg.batch_size} is smaller than the number of devices "
                f"({len(strategy.devices)}); every device needs at least one sample"
            )
        return cfg

    def runtime_config(self) -> RuntimeConfig:
        from paratrain.devices.precision import normalize_precision
        from paratrain.runtime.facade import RuntimeConfig
        from paratrain.strategies import StrategyOptions

        return RuntimeConfig(
            strategy=self.strategy,
            devices=self.devices,
            precision=self.precision,
            seed=self.seed,
            accumulate=self.accumulate,
            sync_batchnorm=self.sync_batchnorm,
            deterministic=self.deterministic,
            speed=self.speed_options(),
            batch_size_per=self.batch_size_per,
            options=StrategyOptions(
                normalize_precision(self.precision),
                self.block_names(),
                _names(self.pipeline_split),
                self.pipeline_schedule,
                self.pipeline_microbatches,
            ),
            threads=self.threads,
            oom=self.oom,
            activation_checkpointing=self.activation_checkpointing,
        )

    def speed_options(self) -> SpeedOptions:
        from paratrain.runtime.speed import SpeedOptions

        return SpeedOptions.of(self.compile, self.channels_last)

    def block_names(self) -> tuple[str, ...]:
        return _names(self.fsdp_blocks)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _names(listed: str | None) -> tuple[str, ...]:
    """``"a, b"`` -> ``("a", "b")``."""
    return tuple(n.strip() for n in (listed or "").split(",") if n.strip())


#: options that only one strategy reads: given to another one, they would do nothing
STRATEGY_OPTIONS = {
    "fsdp_blocks": "fsdp",
    "pipeline_split": "pipeline",
    "pipeline_schedule": "pipeline",
    "pipeline_microbatches": "pipeline",
}


def _check_strategy_options(cfg: TrainConfig, strategy: str) -> None:
    defaults = TrainConfig()
    for name, owner in STRATEGY_OPTIONS.items():
        if strategy != owner and getattr(cfg, name) != getattr(defaults, name):
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{flag} applies to --strategy {owner} only, not {strategy}; drop {flag} or "
                f"use --strategy {owner}"
            )


def _positive(flag: str, value: int | None) -> None:
    if value is None or value < 1:
        raise UserError(f"{flag} must be at least 1, got {value}")
