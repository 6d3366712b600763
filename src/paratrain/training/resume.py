"""``paratrain train --resume``: which checkpoint, and the configuration to continue with.

The configuration comes from the run's ``config.json``. Options given with ``--resume``
may change only what does not alter the training already done: ``--epochs`` and
``--max-steps`` (train further, or stop elsewhere), ``--strategy`` and ``--devices`` (the
data position is a global batch index, the same in every layout), ``--data-dir`` (the same
data moved), ``--data-path`` and ``--device-budget-gib`` (the same batches made another
way), ``--save-every``, ``--keep``, ``--no-progress``, ``--deterministic``, ``--compile``,
``--[no-]channels-last``, ``--download``, ``--tensorboard``, ``--threads``,
``--replicate`` and ``--tp``. Any other option that differs from the run's stops before
training with a message naming each difference. Without ``--threads`` a resumed run uses the
intra-op thread count the run recorded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path
from typing import Any

from paratrain.checkpoints.state.snapshot import MUST_MATCH, damage, read_state
from paratrain.checkpoints.state.store import (
    CHECKPOINTS,
    STATE,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
)
from paratrain.devices.precision import normalize_precision
from paratrain.strategies import FLAT_OWNERS
from paratrain.training import rundir
from paratrain.training.config import TrainConfig, runtime_option_names
from paratrain.training.recipes import get_recipe
from paratrain.utils.errors import UserError

CHANGEABLE = frozenset(
    {
        "epochs",
        "max_steps",
        "strategy",
        "devices",
        "data_dir",
        "save_every",
        "keep",
        "progress",
        "deterministic",
        "data_path",
        "device_budget_gib",
        "compile",  # how fast, not what is trained
        "channels_last",
        "download",
        "tensorboard",
        "threads",  # the last bits of what follows, not what was trained (threads.py)
        "nonfinite",  # how this command watches the run, not what is trained
        "hang_timeout",
        "collective_check",
        "replicate",  # the layout's copies: the same global batches, any layout
        "tp",  # the layers split across processes: the same model, any layout
    }
)
#: options of the command that continues a run, not inherited from the run's first command
PER_COMMAND = ("nonfinite", "hang_timeout")


def find_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run directory, checkpoint) for ``--resume PATH``: a run directory (its newest complete
    checkpoint) or one of its checkpoints, ``RUN/checkpoints/step-N``."""
    given = Path(path)
    if not given.is_dir():
        raise UserError(f"--resume {given}: no such directory; pass a run directory (--out)")
    if given.parent.name == CHECKPOINTS and (given / STATE).is_file():
        if checkpoint_step(given) is None:
            raise UserError(f"--resume {given} is an unfinished checkpoint; pass the run directory")
        problem = damage(given)
        if problem is not None:
            raise UserError(f"--resume {given}: {problem}; resume from another checkpoint")
        return given.parent.parent, given
    if not (given / rundir.CONFIG).is_file():
        raise UserError(
            f"--resume {given} is neither a run directory (no {rundir.CONFIG}) nor a "
            f"checkpoint (no {STATE})"
        )
    _check_entries(given)
    latest = latest_checkpoint(given)
    if latest is None:
        raise UserError(
            f"--resume {given}: the run has no complete checkpoint to continue from; start it "
            f"again with --out {given} --overwrite"
        )
    problem = damage(latest)
    if problem is not None:
        raise UserError(f"--resume {given}: {problem}; {_intact_hint(given, latest)}")
    return given, latest


def _check_entries(run_dir: Path) -> None:
    """Something else put where a checkpoint goes would be overwritten later: refuse."""
    root = run_dir / CHECKPOINTS
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if checkpoint_step(path) is not None and not path.is_dir():
            raise UserError(
                f"--resume {run_dir}: {path} is not a checkpoint (a file, not a directory); "
                "move it out of the way"
            )


def _intact_hint(run_dir: Path, damaged: Path) -> str:
    """Where to go on from: the newest older checkpoint that verifies."""
    for older in reversed(list_checkpoints(run_dir)):
        if older != damaged and damage(older) is None:
            return (
                f"the newest intact checkpoint is {older.name}: move {damaged.name} out of "
                f"{damaged.parent} and resume again to continue from it"
            )
    return f"no older checkpoint is intact: start again with --out {run_dir} --overwrite"


def resume_config(path: str | Path, given: dict[str, Any]) -> TrainConfig:
    """The run's configuration with the changeable options of ``given`` applied.

    ``given`` holds only the options set on the command line. Raises ``UserError`` for a
    conflicting option, a checkpoint that does not match its run, or nothing left to train.
    """
    run_dir, checkpoint = find_checkpoint(path)
    payload = _read_config(run_dir)
    saved = _saved_config(payload, run_dir)
    if given.get("overwrite"):
        raise UserError("--resume continues a run; --overwrite would replace it: drop one")
    out = given.pop("out", None)
    if out is not None and Path(out).resolve() != run_dir.resolve():
        raise UserError(f"--resume continues the run in {run_dir}; drop --out {out}")
    differences = [
        f"{_flag(name)} {_show(value)} (the run: {_show(saved.option(name))})"
        for name, value in given.items()
        if name not in CHANGEABLE and not _same(name, value, saved.option(name))
    ]
    if differences:
        raise UserError(
            f"--resume {path}: {'; '.join(differences)}; drop "
            f"{'this option' if len(differences) == 1 else 'these options'} to continue "
            "the run, or train a new one with --out"
        )
    changes = {name: value for name, value in given.items() if name in CHANGEABLE}
    changes["progress"] = given.get("progress", True)  # not inherited from the first run
    for name in PER_COMMAND:
        changes[name] = given.get(name)
    if "strategy" in given and "devices" not in given:
        changes["devices"] = None  # the run's devices were meant for its strategy
    if "strategy" in given:  # the options of the run's strategy do not apply to another
        defaults = TrainConfig()
        for name in (*FLAT_OWNERS, "replicate", "tp"):  # what only some strategies read
            changes.setdefault(name, given.get(name, defaults.option(name)))
    cfg = saved.replaced(
        **changes, out=str(run_dir), overwrite=False, resume_from=str(checkpoint)
    ).resolved(get_recipe)
    cfg = _recorded_threads(cfg, saved, payload, "threads" in given)
    state = read_state(checkpoint)
    _check_checkpoint(cfg, checkpoint, state)
    _check_processes(cfg, state, checkpoint)
    _check_newer(run_dir, checkpoint)
    _check_work_left(cfg, state, payload.get("status"), checkpoint)
    return cfg


def _recorded_threads(
    cfg: TrainConfig, saved: TrainConfig, payload: dict[str, Any], given: bool
) -> TrainConfig:
    """The resumed run trains with the intra-op threads the run recorded (another count
    sums in another order: the weights would depend on the machine the resume runs on),
    unless ``--threads`` is given or the layout changed its number of processes."""
    if given or cfg.threads is not None:
        return cfg
    runtime = payload.get("runtime")
    recorded = runtime.get("threads") if isinstance(runtime, dict) else None
    count = recorded.get("threads") if isinstance(recorded, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return cfg  # a run from before the count was recorded: chosen again
    if cfg.runtime_config().num_processes != saved.runtime_config().num_processes:
        return cfg  # another layout sums in another order anyway: chosen for it
    return dataclasses.replace(cfg, threads=count)


def _read_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / rundir.CONFIG
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"--resume: {path} is unreadable or not JSON ({exc})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("config"), dict):
        raise UserError(f"--resume: {path} holds no training configuration")
    return payload


def _saved_config(payload: dict[str, Any], run_dir: Path) -> TrainConfig:
    known = {f.name for f in dataclasses.fields(TrainConfig)} - {"runtime_options"}
    values = {k: v for k, v in payload["config"].items() if k in known}
    hints = typing.get_type_hints(TrainConfig)
    for name, value in values.items():
        if not _has_type(value, hints[name]):
            raise UserError(
                f"--resume: {run_dir / rundir.CONFIG} is damaged: {name} is {value!r}, not "
                f"{_type_name(hints[name])}"
            )
    try:
        options = set(runtime_option_names()) - known  # checked by their declarations
        values.update({k: v for k, v in payload["config"].items() if k in options})
        return TrainConfig.of(**values)
    except TypeError as exc:
        raise UserError(f"--resume: {run_dir / rundir.CONFIG} is damaged ({exc})") from None


def _has_type(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field typed ``int``, ``float | None``, ``str``..."""
    for kind in typing.get_args(hint) or (hint,):  # int | None: (int, NoneType)
        if kind is type(None) and value is None:
            return True
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind in (str, bool) and isinstance(value, kind):
            return True
    return False


def _type_name(hint: Any) -> str:
    names = [getattr(t, "__name__", str(t)) for t in typing.get_args(hint) or (hint,)]
    return " or ".join("null" if n == "NoneType" else n for n in names)


def _same(name: str, given: Any, saved: Any) -> bool:
    if name == "precision":
        return bool(normalize_precision(given) == normalize_precision(saved))
    return bool(given == saved)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "not set" if value is None else str(value)


def _check_checkpoint(cfg: TrainConfig, checkpoint: Path, state: dict[str, Any]) -> None:
    for name in MUST_MATCH:
        if name in state and not _same(name, state[name], getattr(cfg, name)):
            raise UserError(
                f"{checkpoint} was saved with {_flag(name)} {state[name]} but the run's "
                f"{rundir.CONFIG} says {getattr(cfg, name)}; it belongs to another run"
            )


def _check_processes(cfg: TrainConfig, state: dict[str, Any], checkpoint: Path) -> None:
    """With --batch-size-per process the global batch depends on the number of processes,
    so the data position (a global batch index) maps only onto the same number."""
    if cfg.batch_size_per != "process" or "world_size" not in state:
        return
    processes = cfg.runtime_config().num_processes
    if processes != state["world_size"]:
        raise UserError(
            f"--resume: {checkpoint} was trained by {state['world_size']} process(es) with "
            f"--batch-size-per process; {processes} would change the global batch: resume "
            f"with {state['world_size']} process(es)"
        )


def _check_newer(run_dir: Path, checkpoint: Path) -> None:
    step = checkpoint_step(checkpoint)
    newer = [p.name for p in list_checkpoints(run_dir) if (checkpoint_step(p) or 0) > (step or 0)]
    if newer:
        raise UserError(
            f"--resume {checkpoint}: the run has newer checkpoints ({', '.join(newer)}); "
            "continuing from an older one would mix two histories: move the newer ones "
            "elsewhere first, or resume from the newest"
        )


def _check_work_left(
    cfg: TrainConfig, state: dict[str, Any], status: Any, checkpoint: Path
) -> None:
    assert cfg.epochs is not None
    trained = state["epoch"] + (1 if state["batch"] else 0)
    if cfg.epochs < trained:
        raise UserError(
            f"--resume: {checkpoint} has trained into epoch {trained}; pass --epochs "
            f"{trained} or more, not {cfg.epochs}"
        )
    if cfg.max_steps is not None and cfg.max_steps < state["step"]:
        raise UserError(
            f"--resume: {checkpoint} is at step {state['step']}; pass --max-steps "
            f"{state['step']} or more, not {cfg.max_steps}"
        )
    total = math.ceil(state["batches_per_epoch"] / cfg.accumulate) * cfg.epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    if status == "finished" and state["step"] >= total:
        raise UserError(
            f"--resume: the run is finished ({state['step']} steps, {cfg.epochs} epoch(s)); "
            "pass a larger --epochs or --max-steps to train further"
        )
