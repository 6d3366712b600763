"""What a search is: recipe and layout, space, trials, scheduler, metric. Checked whole
before Ray starts, and stored in ``tune.json`` so that ``--resume`` continues the same one."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from paratrain.strategies import build_strategy
from paratrain.tools.tune.space import Dimension, parse_space
from paratrain.training.config import TrainConfig
from paratrain.training.recipes import get_recipe
from paratrain.utils.errors import UserError

SCHEDULERS = ("asha", "fifo")
SEARCHES = ("random", "optuna")
#: TrainConfig fields a search may sample, with the type of their values
TUNABLE: dict[str, type] = {
    "lr": float,
    "batch_size": int,
    "accumulate": int,
    "seed": int,
    "precision": str,
    "cifar_stem": bool,
}
TRAIN_METRICS = ("eval_loss", "train_loss")
CLASSIFICATION_METRICS = ("eval_accuracy", *TRAIN_METRICS)


def recipe_metrics(recipe: str) -> tuple[str, ...]:
    """The metrics a recipe's training reports every epoch."""
    return CLASSIFICATION_METRICS if get_recipe(recipe).classification else TRAIN_METRICS


@dataclass
class Resources:
    """What Ray reserves for one trial."""

    cpus: float
    gpus: float

    @classmethod
    def for_config(cls, cfg: TrainConfig, cpus: float | None, gpus: float | None) -> Resources:
        """By default what the strategy uses: a CPU per process, a GPU per CUDA device."""
        strategy = build_strategy(cfg.strategy, cfg.devices)
        cuda = sum(1 for d in strategy.devices if d.type == "cuda")
        resources = cls(
            cpus=float(max(1, strategy.num_processes)) if cpus is None else cpus,
            gpus=float(cuda) if gpus is None else gpus,
        )
        if resources.cpus <= 0 or resources.gpus < 0:
            raise UserError("--cpus-per-trial must be positive and --gpus-per-trial not negative")
        return resources


@dataclass
class TuneSettings:
    #: every trial's configuration before the sampled values are put in (recipe defaults filled)
    base: TrainConfig
    space: list[str]
    trials: int = 4
    scheduler: str = "asha"
    search: str = "random"
    metric: str = ""
    mode: str = ""
    grace_period: int = 1
    reduction_factor: int = 2
    resources: Resources = field(default_factory=lambda: Resources(1.0, 0.0))
    max_concurrent: int | None = None

    def dimensions(self) -> list[Dimension]:
        return parse_space(self.space, TUNABLE)

    def total_trials(self) -> int:
        """``trials`` samples, each of them every combination of the grids."""
        total = self.trials
        for dimension in self.dimensions():
            if dimension.is_grid:
                total *= len(dimension.args)
        return total

    @property
    def epochs(self) -> int:
        assert self.base.epochs is not None
        return self.base.epochs

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["base"] = self.base.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuneSettings:
        values = dict(data)
        values["base"] = TrainConfig.of(**values["base"])
        values["resources"] = Resources(**values["resources"])
        return cls(**values)


def checked(settings: TuneSettings) -> TuneSettings:
    """``settings`` with defaults filled (metric, mode, recipe defaults), or ``UserError``
    naming the first thing wrong; nothing here needs Ray."""
    base = dataclasses.replace(settings.base, progress=False, out=None, overwrite=False)
    base = base.resolved(get_recipe)
    metrics = recipe_metrics(base.recipe)
    metric = settings.metric or metrics[0]
    if metric not in metrics:
        raise UserError(
            f"--metric {metric}: recipe {base.recipe} reports {', '.join(metrics)} every epoch"
        )
    mode = settings.mode or ("max" if metric.endswith("accuracy") else "min")
    if mode not in ("min", "max"):
        raise UserError(f"--mode {mode}: choose min or max")
    _one_of("--scheduler", settings.scheduler, SCHEDULERS)
    _one_of("--search", settings.search, SEARCHES)
    _check_counts(settings)
    settings = dataclasses.replace(settings, base=base, metric=metric, mode=mode)
    dimensions = settings.dimensions()
    if not dimensions:
        raise UserError("give at least one --space, e.g. --space 'lr=loguniform(1e-3,1e-1)'")
    for dimension in dimensions:
        for value in dimension.corners():
            _check_value(base, dimension, value)
    if settings.search == "optuna":
        if any(d.is_grid for d in dimensions):
            raise UserError("grid(...) enumerates values itself: use it with --search random")
        if importlib.util.find_spec("optuna") is None:
            raise UserError('--search optuna needs Optuna: pip install "paratrain[tune-optuna]"')
    return settings


def _check_counts(settings: TuneSettings) -> None:
    """Trials, the scheduler's grace period and reduction factor, trials at a time."""
    for flag, value in (("--trials", settings.trials), ("--grace-period", settings.grace_period)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if settings.reduction_factor < 2:
        raise UserError(f"--reduction-factor must be at least 2, got {settings.reduction_factor}")
    if settings.max_concurrent is not None and settings.max_concurrent < 1:
        raise UserError(f"--max-concurrent must be at least 1, got {settings.max_concurrent}")


def _one_of(flag: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise UserError(f"{flag} {value}: choose one of {', '.join(valid)}")


def _check_value(base: TrainConfig, dimension: Dimension, value: Any) -> None:
    """A sampled value must give a valid training configuration (the same checks as
    ``paratrain train``): positive lr, a batch no smaller than the devices..."""
    try:
        dataclasses.replace(base, **{dimension.name: value}).resolved(get_recipe)
    except UserError as exc:
        raise UserError(f"--space {dimension.text!r}: {dimension.name}={value!r}: {exc}") from None
