"""One trial: a ``paratrain train`` run of the sampled configuration, inside a Ray worker.

Its run directory is ``OUT/trials/<trial id>`` in paratrain's usual layout. Every epoch the
run's main process hands its figures to this process (:mod:`paratrain.tools.tune.channel`), which
reports them to Ray Tune with the epoch's checkpoint, so a scheduler can stop the trial
early and a stopped or interrupted trial continues from its last reported epoch.

The last epoch is reported only once the run has finished (weights and ``config.json``
written): a scheduler stops a trial at its last report, before the run could finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.checkpoints.state.store import latest_checkpoint, remove_checkpoints
from paratrain.runtime.facade import Runtime
from paratrain.tools.tune.channel import EpochLink, TrialBridge
from paratrain.training import rundir
from paratrain.training.config import TrainConfig
from paratrain.training.loop import Summary, train
from paratrain.training.recipes import get_recipe

TRIALS = "trials"


@dataclass(frozen=True)
class TrialJob:
    """What every trial of a search shares: the configuration the sampled values go into
    and the search's output directory (absolute: trials run in other processes)."""

    base: TrainConfig
    out: str

    def run_dir(self, trial_id: str) -> Path:
        return Path(self.out) / TRIALS / trial_id

    def config_for(self, sampled: dict[str, Any], trial_id: str) -> TrainConfig:
        cfg = dataclasses.replace(self.base, **sampled, out=str(self.run_dir(trial_id)))
        return cfg.resolved(get_recipe)


def run_trial(config: dict[str, Any], job: TrialJob) -> None:
    """The Ray Tune trainable: ``config`` holds the sampled values."""
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    cfg = job.config_for(config, trial_id)
    directory = Path(str(cfg.out))
    with contextlib.ExitStack() as stack:
        checkpoint = tune.get_checkpoint()
        if checkpoint is None:  # a new trial, or one restarted from scratch
            rundir.prepare(directory, cfg.recipe, overwrite=True)
        else:
            # Continue from the last reported epoch; checkpoints written after it belong
            # to a history the search never saw.
            cfg.resume_from = stack.enter_context(checkpoint.as_directory())
            remove_checkpoints(directory)
        bridge = TrialBridge()
        final: dict[str, Any] | None = None
        for record in bridge.run(lambda link: _train(cfg, directory, link)):
            if _is_last(cfg, record):
                final = record  # reported below, once the run is complete
            else:
                _report(record, directory)
        summary: Summary = bridge.result
        if final is None and summary is not None:  # nothing was left to train
            final = {"epoch": summary.epochs - 1, "train_loss": summary.train_loss}
            final |= {"eval_loss": summary.eval_loss, "eval_accuracy": summary.eval_accuracy}
        if final is not None:
            _report(final, directory)


def _train(cfg: TrainConfig, directory: Path, link: EpochLink) -> Summary | None:
    """The run, in as many processes as its strategy needs (``rt.launch``)."""
    rt = Runtime.from_config(cfg.runtime_config())
    return rt.launch(_train_in_process, cfg, str(directory), link)


def _train_in_process(rt: Runtime, cfg: TrainConfig, directory: str, link: EpochLink) -> Summary:
    return train(rt, cfg, Path(directory), on_epoch=link)


def _is_last(cfg: TrainConfig, record: dict[str, Any]) -> bool:
    assert cfg.epochs is not None
    steps_left = cfg.max_steps is not None and record.get("step", 0) >= cfg.max_steps
    return record["epoch"] + 1 >= cfg.epochs or steps_left


def _report(record: dict[str, Any], directory: Path) -> None:
    """Report one epoch (``training_iteration`` = epochs done) with the run's newest
    checkpoint: the one written at the end of that epoch."""
    from ray import tune

    # A diverged loss (NaN) is the worst loss: schedulers skip NaN and would keep the trial.
    metrics = {
        key: math.inf if math.isnan(float(value)) else float(value)
        for key, value in record.items()
        if key != "epoch" and value is not None
    }
    metrics["epoch"] = record["epoch"] + 1
    path = latest_checkpoint(directory)
    checkpoint = None if path is None else tune.Checkpoint.from_directory(str(path))
    tune.report(metrics, checkpoint=checkpoint)
