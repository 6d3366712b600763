"""`paratrain tune`: check the search whole, then run it on Ray Tune (paratrain.tools.tune)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console

from paratrain.cli.commands.train import (
    add_run_arguments,
    add_training_arguments,
    fetch_data,
    given_options,
)
from paratrain.training.config import TrainConfig
from paratrain.utils.errors import UserError

#: options that define a search: --resume takes them from the search's tune.json
_SEARCH_OPTIONS = (
    "space",
    "trials",
    "scheduler",
    "search",
    "metric",
    "mode",
    "grace_period",
    "reduction_factor",
    "cpus_per_trial",
    "gpus_per_trial",
    "max_concurrent",
    "out",
    "overwrite",
)

_PLACED_BY_RAY = "Ray places the trials (--address spreads them over a cluster's machines)"
_ENVIRONMENT = (
    "it reaches a run's processes through the environment of `paratrain train`, which a "
    "trial's Ray worker does not get"
)
#: options of `paratrain train` that make no sense in a trial: (is a flag, why refused)
REFUSED: dict[str, tuple[bool, str]] = {
    "--fresh": (True, "a search starts over with --overwrite"),
    "--nnodes": (False, _PLACED_BY_RAY),
    "--node-rank": (False, _PLACED_BY_RAY),
    "--rdzv-endpoint": (False, _PLACED_BY_RAY),
    "--max-restarts": (False, "a failed trial is not restarted; the search reports it as error"),
    "--requeue": (True, "a search interrupted is continued with --resume, not a SLURM requeue"),
    "--hang-timeout": (False, _ENVIRONMENT),
    "--skip-nonfinite": (True, _ENVIRONMENT),
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tune",
        help="search hyper-parameters of a recipe on Ray Tune",
        description=(
            "Run trials of a recipe with sampled hyper-parameters on Ray Tune (started here, "
            "or the cluster at --address); each trial is a paratrain training run of the "
            "given strategy, reporting every epoch so that ASHA stops bad trials early. "
            "Every option of `paratrain train` sets the trials' runs, except "
            f"{', '.join(REFUSED)} (refused, saying why) and --resume, --out and "
            "--overwrite, which here mean the search's."
        ),
    )
    add_training_arguments(p)
    seed = next(action for action in p._actions if action.dest == "seed")
    seed.help = "seeds the search and every trial's training (default 0)"
    add_run_arguments(p)
    for flag, (is_flag, _why) in REFUSED.items():
        kind: dict[str, Any] = {"action": "store_true"} if is_flag else {}
        p.add_argument(flag, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kind)
    p.add_argument(
        "--space",
        action="append",
        metavar="NAME=DIST(ARGS)",
        help="a hyper-parameter and its distribution, e.g. 'lr=loguniform(1e-3,1e-1)'; "
        "uniform, quniform, loguniform, randint, lograndint, choice, grid; repeatable",
    )
    p.add_argument("--trials", type=int, help="trials to sample (grid: repeats of it); 4")
    p.add_argument("--scheduler", help="asha (stop bad trials early; default) or fifo")
    p.add_argument("--search", help="random (default) or optuna")
    p.add_argument("--metric", help="eval_accuracy (default), eval_loss or train_loss")
    p.add_argument("--mode", help="max or min; default: max for accuracy, min for a loss")
    p.add_argument("--grace-period", type=int, help="ASHA: epochs before a trial may stop (1)")
    p.add_argument("--reduction-factor", type=int, help="ASHA: keep 1/N at each rung (2)")
    p.add_argument("--cpus-per-trial", type=float, help="default: one per process of the run")
    p.add_argument("--gpus-per-trial", type=float, help="default: the run's CUDA devices")
    p.add_argument("--max-concurrent", type=int, help="trials at once; default: as resources allow")
    p.add_argument("--address", help="join this Ray cluster (default: start Ray here)")
    p.add_argument("--out", help="output directory; default runs/tune-<recipe>-<timestamp>")
    p.add_argument("--overwrite", action="store_true", default=None, help="replace a search")
    p.add_argument("--resume", metavar="DIR", help="continue the interrupted search in DIR")
    p.add_argument("--no-progress", action="store_true", help="no live table of trials")
    p.add_argument("--no-plot", action="store_true", help="do not write tune.png")
    # Every option left out stays None, so that --resume knows which ones were given.
    p.set_defaults(handler=run, **dict.fromkeys(f.name for f in dataclasses.fields(TrainConfig)))


def settings_from_args(args: argparse.Namespace) -> Any:
    from paratrain.tools.tune.settings import Resources, TuneSettings, checked
    from paratrain.training.mlflow_logger import require_mlflow, tracking_uri
    from paratrain.training.tensorboard_logger import require_tensorboard

    given = given_options(args)
    given.pop("out", None)
    given.pop("overwrite", None)
    given.pop("progress", None)
    # Trials run in Ray's workers, elsewhere than here: folders are made absolute.
    if given.get("data_dir") is not None:
        given["data_dir"] = str(Path(given["data_dir"]).expanduser().resolve())
    if given.get("mlflow") is not None:
        require_mlflow()
        given["mlflow"] = tracking_uri(given["mlflow"])
    if given.get("tensorboard"):
        require_tensorboard()
    base = TrainConfig.of(**given)
    resources = Resources.for_config(base, args.cpus_per_trial, args.gpus_per_trial)
    settings = TuneSettings(
        base=base,
        space=list(args.space or []),
        trials=4 if args.trials is None else args.trials,
        scheduler=args.scheduler or "asha",
        search=args.search or "random",
        metric=args.metric or "",
        mode=args.mode or "",
        grace_period=1 if args.grace_period is None else args.grace_period,
        reduction_factor=2 if args.reduction_factor is None else args.reduction_factor,
        resources=resources,
        max_concurrent=args.max_concurrent,
    )
    return checked(settings)


def fetch_once(settings: Any) -> None:
    """``--download``: the data is fetched here, once, before any trial starts (as
    `paratrain train` does before its processes); the trials read the folder."""
    if settings.base.download:
        settings.base.data_dir = fetch_data(settings.base)


def _resumed_settings(args: argparse.Namespace) -> tuple[Any, Path]:
    from paratrain.tools.tune.report import read_report
    from paratrain.tools.tune.settings import TuneSettings

    given = [f"--{name.replace('_', '-')}" for name in _SEARCH_OPTIONS if getattr(args, name)]
    given += [f"--{name.replace('_', '-')}" for name in given_options(args) if name != "progress"]
    if given:
        raise UserError(
            f"--resume {args.resume} continues the search as it was started; drop "
            f"{', '.join(sorted(set(given)))} (or start a new search with --out)"
        )
    out = Path(args.resume)
    return TuneSettings.from_dict(read_report(out)["settings"]), out


def refuse_train_only_options(args: argparse.Namespace) -> None:
    """The options of `paratrain train` a trial cannot take: named, with why, in one line."""
    # a flag left out is absent, or None where a TrainConfig field of its name defaults it
    given = [
        flag
        for flag in REFUSED
        if getattr(args, flag.removeprefix("--").replace("-", "_"), None) is not None
    ]
    if given:
        reasons = "; ".join(f"{flag}: {REFUSED[flag][1]}" for flag in given)
        raise UserError(f"paratrain tune takes no {reasons} (see: paratrain tune --help)")


def run(args: argparse.Namespace) -> int:
    from paratrain.tools.tune.engine import require_ray
    from paratrain.tools.tune.report import prepare_out
    from paratrain.tools.tune.search import recipe_search

    refuse_train_only_options(args)
    if args.resume is not None:
        settings, out = _resumed_settings(args)
    else:
        settings = settings_from_args(args)
    require_ray()  # after the input is checked: bad input is found without Ray too
    fetch_once(settings)
    if args.resume is None:
        out = prepare_out(args.out, settings.base.recipe, bool(args.overwrite))
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # piped output: no need to squeeze into 80 columns
    return recipe_search(
        settings,
        out,
        address=args.address,
        progress=not args.no_progress,
        plot=not args.no_plot,
        resume=args.resume is not None,
        console=console,
    )
