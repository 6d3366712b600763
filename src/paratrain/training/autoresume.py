"""The same ``paratrain train`` command run again on the same ``--out``: continue the run.

A preempted job is requeued with its command unchanged; so the default, without an option:

* ``--out`` holds no run: a new one starts there;
* it holds a run with the same configuration: it continues from the newest complete
  checkpoint, as ``--resume`` would (a note says from where); with none complete yet, it
  starts again in place; a finished run with nothing left to train is left as it is;
* it holds a run with another configuration: refused, each differing option named.

"The same configuration" is every setting that shapes the training, compared after the
recipe's defaults are filled in; the options ``--resume`` may change (``--epochs``,
``--max-steps``, ``--strategy``, ``--devices``, where the data lives, how often to save...)
may differ, so a requeued job on another allocation continues too. ``--fresh`` starts over
without destroying anything: the old run directory is renamed ``OUT.before-<time>``.
``--overwrite`` still replaces the run's files.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from paratrain.checkpoints.state import latest_checkpoint, read_state
from paratrain.devices.precision import normalize_precision
from paratrain.training import run_lock, rundir
from paratrain.training.config import TrainConfig, runtime_option_names
from paratrain.training.recipes import get_recipe
from paratrain.training.resume import CHANGEABLE, resume_config
from paratrain.utils import environment
from paratrain.utils.errors import UserError

#: fields that say where and how this command runs, not what it trains
_NOT_COMPARED = CHANGEABLE | {"out", "overwrite", "resume_from", "progress"}


def _note(message: str) -> None:
    if environment.current().is_rank_zero:  # under torchrun, once
        print(f"paratrain: note: {message}", file=sys.stderr, flush=True)


def differences(saved: TrainConfig, wanted: TrainConfig) -> list[str]:
    """``--option value (the run: value)`` for each setting that shapes training and differs."""
    found = []
    names = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "runtime_options"]
    names += sorted(set(saved.runtime_options) | set(wanted.runtime_options))
    for name in names:
        if name in _NOT_COMPARED:
            continue
        old, new = saved.option(name), wanted.option(name)
        if name == "precision":
            old, new = normalize_precision(old), normalize_precision(new)
        if old != new:
            found.append(f"--{name.replace('_', '-')} {_show(new)} (the run: {_show(old)})")
    return found


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "not set" if value is None else str(value)


def plan(cfg: TrainConfig, given: dict[str, Any]) -> TrainConfig | None:
    """The configuration to train with: ``cfg`` (a new run), a resumed one, or None when
    ``--out`` holds this run finished with nothing left to train. ``given``: the options set
    on the command line."""
    if cfg.out is None or cfg.overwrite:
        return cfg
    directory = Path(cfg.out)
    status = rundir.read_status(directory) if directory.is_dir() else None
    if status is None:
        return cfg
    payload = rundir.read_config(directory)
    if payload is None:
        raise UserError(
            f"--out {directory} holds an unfinished run without a readable {rundir.CONFIG}; "
            "pass --fresh to start over (it is moved aside) or choose another --out"
        )
    known = {field.name for field in dataclasses.fields(TrainConfig)} | set(runtime_option_names())
    saved = TrainConfig.of(**{k: v for k, v in payload.items() if k in known})
    wanted = cfg.resolved(get_recipe)
    found = differences(saved, wanted)  # config.json holds the resolved configuration
    if found:
        raise UserError(
            f"--out {directory} holds a run with another configuration: {'; '.join(found)}; "
            "run its command to continue it, pass --fresh to start over (the old run is "
            "moved aside) or --overwrite to replace it, or choose another --out"
        )
    checkpoint = latest_checkpoint(directory)
    if checkpoint is None:
        _note(f"{directory} holds this run with no complete checkpoint yet: starting it again")
        return dataclasses.replace(cfg, overwrite=True)
    if status == "finished" and _trained_out(wanted, checkpoint):
        _note(f"{directory} holds this run, finished; nothing to do (--fresh trains it again)")
        return None
    resumed = resume_config(directory, dict(given))
    _note(f"{directory} holds this run, unfinished: continuing from {checkpoint}")
    return resumed


def _trained_out(cfg: TrainConfig, checkpoint: Path) -> bool:
    """Whether ``checkpoint`` is at the last step ``cfg`` trains to."""
    state = read_state(checkpoint)
    assert cfg.epochs is not None
    total = math.ceil(state["batches_per_epoch"] / cfg.accumulate) * cfg.epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return int(state["step"]) >= total


def set_aside(out: str | None) -> Path | None:
    """``--fresh``: rename a run directory to ``OUT.before-<time>``; the new name, or None
    when ``out`` holds no run. The lock of the command that moves it stays on ``OUT``: it
    is this command's, not the old run's."""
    if out is None:
        return None
    directory = Path(out)
    if not directory.is_dir() or rundir.read_status(directory) is None:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = directory.with_name(f"{directory.name}.before-{stamp}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = directory.with_name(f"{directory.name}.before-{stamp}-{suffix}")
    os.rename(directory, target)
    if (target / run_lock.LOCK).exists():
        directory.mkdir()
        os.replace(target / run_lock.LOCK, directory / run_lock.LOCK)
    _note(f"--fresh: the previous run in {directory} was moved to {target}")
    return target
