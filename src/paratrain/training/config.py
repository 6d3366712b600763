"""The training configuration: a plain dataclass, checked before any process starts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from paratrain.utils.errors import UserError

if TYPE_CHECKING:  # the command line builds its parsers from TrainConfig without torch
    from torch import nn

    from paratrain.runtime.config import RuntimeConfig

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
    #: NaN or infinite losses: error, skip (--skip-nonfinite) or off; None: PARATRAIN_NONFINITE
    nonfinite: str | None = None
    #: seconds without progress before the run is stopped (--hang-timeout); None: 600
    hang_timeout: float | None = None
    #: processes that disagree about the next collective are stopped (--no-collective-check)
    collective_check: bool = True
    #: every other option of the runtime set for this run, by its ``Runtime(...)`` keyword:
    #: a runtime option needs no field here (its declaration in paratrain.runtime.config is
    #: its flag, its help and its check); config.json holds them flat, beside the fields
    runtime_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, **values: Any) -> TrainConfig:
        """From flat settings (the command line's, config.json's): a field each where there
        is one, every other runtime keyword in :attr:`runtime_options`; anything else is a
        ``TypeError``, as an unknown keyword of the class would be."""
        fields = {spec.name for spec in dataclasses.fields(cls)} - {"runtime_options"}
        own = {name: value for name, value in values.items() if name in fields}
        rest = {name: value for name, value in values.items() if name not in fields}
        unknown = set(rest) - set(runtime_option_names())
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        options = {**values.get("runtime_options", {}), **rest}
        return cls(**own, runtime_options=options)

    def option(self, name: str) -> Any:
        """A runtime option's value for this run: its field, what was set, or its default."""
        if name in self.runtime_options:
            return self.runtime_options[name]
        if name in {spec.name for spec in dataclasses.fields(self)}:
            return getattr(self, name)
        return runtime_option_defaults()[name]

    def replaced(self, **changes: Any) -> TrainConfig:
        """``dataclasses.replace`` that also takes runtime keywords without a field."""
        return TrainConfig.of(**{**self.to_dict(), **changes})

    def resolved(self, recipes: RecipeLookup) -> TrainConfig:
        """A copy with the recipe's defaults filled in, or ``UserError`` naming what is wrong.

        ``recipes`` finds the recipe by name (``paratrain.training.recipes.get_recipe``). The
        runtime's options are checked by their declarations (:meth:`runtime_config`); the
        strategy is built once to check devices, data path, speed options, the model and
        the batch arithmetic here, before any process or process group exists.
        """
        from paratrain.data.paths import check_data_path
        from paratrain.runtime.speed import check_speed
        from paratrain.strategies import build_strategy, check_sync_batchnorm

        recipe = recipes(self.recipe)
        runtime = self.runtime_config()
        cfg = dataclasses.replace(
            self,
            epochs=recipe.epochs if self.epochs is None else self.epochs,
            batch_size=recipe.batch_size if self.batch_size is None else self.batch_size,
            lr=recipe.lr if self.lr is None else self.lr,
            precision=runtime.precision,
        )
        _positive("--epochs", cfg.epochs)
        _positive("--batch-size", cfg.batch_size)
        if cfg.max_steps is not None:
            _positive("--max-steps", cfg.max_steps)
        if cfg.save_every is not None:
            _positive("--save-every", cfg.save_every)
        if cfg.profile is not None:
            _positive("--profile", cfg.profile)
        _positive("--keep", cfg.keep)
        if cfg.synthetic is not None:
            _positive("--synthetic", cfg.synthetic)
        if cfg.lr is None or not (cfg.lr > 0 and math.isfinite(cfg.lr)):
            raise UserError(f"--lr must be a positive number, got {cfg.lr}")
        if not 0 <= cfg.seed < 2**63:
            raise UserError(f"--seed must be between 0 and 2**63-1, got {cfg.seed}")
        recipe.check_data_options(cfg.data_dir, cfg.synthetic, cfg.download)
        strategy = build_strategy(runtime.strategy, runtime.devices, runtime.options)
        check_sync_batchnorm(strategy, cfg.sync_batchnorm)
        check_data_path(cfg.data_path, cfg.device_budget_gib, strategy.devices[0])
        check_speed(strategy, runtime.speed)
        if strategy.checks_model:  # e.g. fsdp on a model without parameters
            import torch

            with torch.device("meta"):  # shapes are enough: nothing is allocated
                strategy.check_model(recipe.build_model(cfg))
        assert cfg.batch_size is not None
        per_process = cfg.batch_size_per == "process"
        if cfg.batch_size * (strategy.num_processes if per_process else 1) < len(strategy.devices):
            raise UserError(
                f"--batch-size {cfg.batch_size} is smaller than the number of devices "
                f"({len(strategy.devices)}); every device needs at least one sample"
            )
        return cfg

    def runtime_config(self) -> RuntimeConfig:
        """The runtime's configuration: every field named as a ``Runtime(...)`` keyword,
        checked by the option's declaration (:mod:`paratrain.runtime.config`)."""
        from paratrain.runtime.config import RuntimeConfig, runtime_keywords

        given = {
            name: getattr(self, name) for name, _, _ in runtime_keywords() if hasattr(self, name)
        }
        return RuntimeConfig.from_keywords(**given, **self.runtime_options)

    def to_dict(self) -> dict[str, Any]:
        """Flat: the fields, and the runtime options without one beside them."""
        values = dataclasses.asdict(self)
        return {**values.pop("runtime_options"), **values}


def runtime_option_names() -> list[str]:
    """Every ``Runtime(...)`` keyword (its declarations: paratrain.runtime.config)."""
    from paratrain.runtime.config import runtime_keywords

    return [name for name, _, _ in runtime_keywords()]


def runtime_option_defaults() -> dict[str, Any]:
    from paratrain.runtime.config import runtime_keywords

    return {name: default for name, default, _ in runtime_keywords()}


def _positive(flag: str, value: int | None) -> None:
    if value is None or value < 1:
        raise UserError(f"{flag} must be at least 1, got {value}")
