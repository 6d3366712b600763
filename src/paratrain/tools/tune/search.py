"""A search from start to end: Ray up, trials run, then the table, tune.json, tune.png and
``OUT/best``. Also :func:`tune_function`, the same machinery for a user's own loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from paratrain.tools.tune.chart import MISSING_MATPLOTLIB, write_chart
from paratrain.tools.tune.display import Row, build_table
from paratrain.tools.tune.engine import SearchPlan, build_tuner, ray_running, restore_tuner
from paratrain.tools.tune.outcome import BEST, TrialOutcome, copy_best, outcome_of, pick_best
from paratrain.tools.tune.report import TUNE_PNG, read_report, start_report, write_report
from paratrain.tools.tune.settings import TuneSettings
from paratrain.tools.tune.space import parse_space, to_ray
from paratrain.tools.tune.trial import TrialJob, run_trial
from paratrain.utils.errors import LaunchError

#: exit code of a search stopped with Ctrl+C (continued with --resume)
INTERRUPTED = 130


def plan_for(settings: TuneSettings, progress: bool) -> SearchPlan:
    callbacks = []
    if progress:
        from paratrain.tools.tune.live import LiveTrialsCallback

        title = f"paratrain tune: {settings.base.recipe}"
        callbacks.append(LiveTrialsCallback(settings.metric, settings.mode, title))
    return SearchPlan(
        param_space=to_ray(settings.dimensions()),
        metric=settings.metric,
        mode=settings.mode,
        trials=settings.trials,
        max_epochs=settings.epochs,
        scheduler=settings.scheduler,
        search=settings.search,
        seed=settings.base.seed,
        grace_period=settings.grace_period,
        reduction_factor=settings.reduction_factor,
        cpus=settings.resources.cpus,
        gpus=settings.resources.gpus,
        max_concurrent=settings.max_concurrent,
        callbacks=callbacks,
    )


def recipe_search(
    settings: TuneSettings,
    out: Path,
    *,
    address: str | None = None,
    progress: bool = True,
    plot: bool = True,
    resume: bool = False,
    console: Console | None = None,
) -> int:
    """Run (or with ``resume`` continue) the search into ``out``; returns the exit code."""
    from ray import tune

    console = console or Console()
    report = read_report(out) if resume else start_report(settings, address)
    report["status"] = "running"
    write_report(out, report)
    job = TrialJob(settings.base, str(out.resolve()))
    plan = plan_for(settings, progress)
    trainable = tune.with_parameters(run_trial, job=job)
    started = time.perf_counter()
    with ray_running(address):
        tuner = restore_tuner(trainable, plan, out) if resume else build_tuner(trainable, plan, out)
        grid = tuner.fit()
    outcomes = sorted(
        (outcome_of(r, job.run_dir(Path(r.path).name), settings.metric, r.config) for r in grid),
        key=lambda o: o.trial_id,
    )
    # Stopped by Ctrl+C: a trial left in the middle, or trials never started.
    interrupted = len(outcomes) < settings.total_trials() or any(
        o.status == "unfinished" for o in outcomes
    )
    best = pick_best(outcomes, settings.mode)
    if best is not None:
        copy_best(best, out)
    report.update(
        status="interrupted" if interrupted else "finished",
        finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        wall_seconds=report.get("wall_seconds", 0.0) + time.perf_counter() - started,
        scheduler=_scheduler_record(plan),
        trials=[o.to_dict(settings.mode, out) for o in outcomes],
        best=None if best is None else {**best.to_dict(settings.mode, out), "copied_to": BEST},
    )
    write_report(out, report)
    title = f"paratrain tune: {settings.base.recipe}, {settings.metric} ({settings.mode})"
    if plot and not write_chart(outcomes, best, settings.metric, title, out / TUNE_PNG):
        console.print(MISSING_MATPLOTLIB, markup=False, highlight=False)
    _print_outcome(console, outcomes, best, settings, title, out)
    if interrupted:
        console.print(f"search interrupted; continue it with: paratrain tune --resume {out}")
        return INTERRUPTED
    if best is None:
        errors = [f"{o.trial_id}: {o.error}" for o in outcomes if o.error]
        raise LaunchError("no trial finished" + (f"; {errors[0]}" if errors else ""))
    return 0


def _scheduler_record(plan: SearchPlan) -> dict[str, Any]:
    if plan.scheduler == "fifo":
        return {"name": "fifo"}
    return {
        "name": "asha",
        "time_attr": "training_iteration (epochs)",
        "max_t": plan.max_epochs,
        "grace_period": min(plan.grace_period, plan.max_epochs),
        "reduction_factor": plan.reduction_factor,
    }


def _print_outcome(
    console: Console,
    outcomes: list[TrialOutcome],
    best: TrialOutcome | None,
    settings: TuneSettings,
    title: str,
    out: Path,
) -> None:
    rows = [
        Row(o.trial_id, o.config, o.epochs, o.last, o.best(settings.mode), o.status)
        for o in outcomes
    ]
    marked = None if best is None else best.trial_id
    console.print(build_table(rows, settings.metric, title, marked))
    for outcome in outcomes:
        if outcome.error:
            console.print(f"error: {outcome.trial_id}: {outcome.error}", markup=False)
    if best is not None:
        console.print(
            f"best: {best.trial_id} ({settings.metric} {best.last:.4f}); its run is in "
            f"{out / BEST}; all results in {out / 'tune.json'}",
            markup=False,
            highlight=False,
        )


def tune_function(
    fn: Callable[[dict[str, Any]], None],
    space: list[str],
    *,
    metric: str,
    mode: str,
    trials: int,
    max_epochs: int,
    out: str | Path,
    scheduler: str = "asha",
    search: str = "random",
    seed: int = 0,
    cpus_per_trial: float = 1.0,
    gpus_per_trial: float = 0.0,
    address: str | None = None,
) -> Any:
    """Search your own training function with Ray Tune; returns Ray's ``ResultGrid``.

    ``fn(config)`` trains with ``config`` (the values sampled from ``space``, written as
    for ``--space``) and calls ``ray.tune.report({metric: value, ...})`` after every epoch,
    at most ``max_epochs`` times. Ray runs as for ``paratrain tune``: started here and
    stopped after, or the cluster at ``address``; its experiment goes to ``out/ray``.
    """
    from paratrain.tools.tune.engine import require_ray

    require_ray()
    plan = SearchPlan(
        param_space=to_ray(parse_space(space)),
        metric=metric,
        mode=mode,
        trials=trials,
        max_epochs=max_epochs,
        scheduler=scheduler,
        search=search,
        seed=seed,
        cpus=cpus_per_trial,
        gpus=gpus_per_trial,
    )
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    with ray_running(address):
        return build_tuner(fn, plan, directory).fit()
