"""Ray Tune, set up: where Ray runs, the scheduler, the search algorithm, the Tuner.

Ray is imported here only inside functions, after the command has checked its input, so
``paratrain --help`` and bad input never wait for Ray, and a missing Ray is one line.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratrain.utils import environment
from paratrain.utils.errors import UserError

#: Ray's experiment folder inside the search's --out (its state, results, checkpoints)
RAY_DIR = "ray"
NEEDS_RAY = 'paratrain tune needs Ray: pip install "paratrain[tune]"'


def require_ray() -> None:
    """``UserError`` saying how to get Ray, where it is missing."""
    try:
        import ray.tune  # noqa: F401
    except ImportError:
        raise UserError(NEEDS_RAY) from None


@dataclass
class SearchPlan:
    """What Ray Tune is asked to do, whatever the trials train."""

    param_space: dict[str, Any]
    metric: str
    mode: str
    trials: int
    #: the number of reports (epochs) of a complete trial: ASHA's ``max_t``
    max_epochs: int
    scheduler: str = "asha"
    search: str = "random"
    seed: int = 0
    grace_period: int = 1
    reduction_factor: int = 2
    cpus: float = 1.0
    gpus: float = 0.0
    max_concurrent: int | None = None
    callbacks: list[Any] = field(default_factory=list)


@contextlib.contextmanager
def ray_running(address: str | None = None) -> Iterator[None]:
    """Ray for the duration of a search: a local instance started here and stopped after
    (``address=None``), or a running cluster joined. A session already open is used as is."""
    import ray

    if ray.is_initialized():
        yield
        return
    environment.set_default("RAY_USAGE_STATS_ENABLED", "0")  # no prompt, nothing sent
    # Every epoch's checkpoint snapshots the experiment state: small here, not a bottleneck.
    environment.set_default("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # Ray's own experiment table and hints: paratrain draws its own (verbose=0 is silent so).
    environment.set_default("RAY_AIR_NEW_OUTPUT", "0")
    quiet: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    if address is None:
        # Ray's default for a new cluster (token authentication) stays; its notice goes.
        logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)
        # "local": a new instance even where another one runs on this machine
        ray.init(address="local", include_dashboard=False, **quiet)
    else:
        # The cluster's workers import this very paratrain, shipped with the job.
        import paratrain

        package = str(Path(paratrain.__file__).parent)
        ray.init(address=address, runtime_env={"py_modules": [package]}, **quiet)
    try:
        yield
    finally:
        ray.shutdown()


def trial_dirname(trial: Any) -> str:
    """Ray's folder of a trial is named by its id, as its run directory is."""
    return str(trial.trial_id)


def _scheduler(plan: SearchPlan) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if plan.scheduler == "fifo":
        return FIFOScheduler()
    return ASHAScheduler(
        time_attr="training_iteration",
        max_t=plan.max_epochs,
        grace_period=min(plan.grace_period, plan.max_epochs),
        reduction_factor=plan.reduction_factor,
    )


def _search_algorithm(plan: SearchPlan) -> Any:
    """Seeded, so that the same search samples the same configurations; it also holds the
    concurrency limit (Ray ignores ``max_concurrent_trials`` for the random search)."""
    if plan.search == "optuna":
        import optuna as optuna_package
        from ray.tune.search import ConcurrencyLimiter
        from ray.tune.search.optuna import OptunaSearch

        optuna_package.logging.set_verbosity(optuna_package.logging.WARNING)  # one line a trial
        optuna = OptunaSearch(seed=plan.seed)
        if plan.max_concurrent is None:
            return optuna
        return ConcurrencyLimiter(optuna, max_concurrent=plan.max_concurrent)
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return BasicVariantGenerator(random_state=plan.seed, max_concurrent=plan.max_concurrent or 0)


def _with_resources(trainable: Any, plan: SearchPlan) -> Any:
    from ray import tune

    return tune.with_resources(trainable, {"cpu": plan.cpus, "gpu": plan.gpus})


def build_tuner(trainable: Any, plan: SearchPlan, out: Path) -> Any:
    """A ``ray.tune.Tuner`` whose experiment lives in ``out/ray``."""
    from ray import tune

    return tune.Tuner(
        _with_resources(trainable, plan),
        param_space=plan.param_space,
        tune_config=tune.TuneConfig(
            metric=plan.metric,
            mode=plan.mode,
            search_alg=_search_algorithm(plan),
            scheduler=_scheduler(plan),
            num_samples=plan.trials,
            # A finished trial's worker process trains the next one: no new process, no new
            # imports. (Stopped trials' processes are replaced: their threads are blocked.)
            reuse_actors=True,
            trial_dirname_creator=trial_dirname,
        ),
        run_config=tune.RunConfig(
            name=RAY_DIR,
            storage_path=str(out.resolve()),
            verbose=0,
            callbacks=plan.callbacks,
            # the newest reported checkpoint is enough to continue a trial
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
        ),
    )


def restore_tuner(trainable: Any, plan: SearchPlan, out: Path) -> Any:
    """The interrupted search in ``out/ray``: unfinished trials continue from their last
    reported epoch, trials not yet started start; finished and failed ones stay as they are."""
    from ray import tune

    path = str((out / RAY_DIR).resolve())
    if not tune.Tuner.can_restore(path):
        raise UserError(f"--resume {out}: no Ray Tune experiment in {out / RAY_DIR}")
    tuner = tune.Tuner.restore(
        path, trainable=_with_resources(trainable, plan), resume_unfinished=True
    )
    local = getattr(tuner, "_local_tuner", None)
    if local is not None:  # this run's display (--no-progress), not the one stored with it
        local.get_run_config().callbacks = plan.callbacks
    return tuner
