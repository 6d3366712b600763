"""`paratrain train`: validate everything, prepare --out, then train in every process."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.cli.commands.launch_options import (
    add_launch_arguments,
    nodes_from_args,
    requeue_on_stop,
    slurm_nodes,
)
from paratrain.launching.agent import Nodes
from paratrain.launching.preemption import Stopped
from paratrain.launching.slurm import SlurmTasks
from paratrain.launching.threads import say_note, started_note
from paratrain.runtime.config import check_hang_timeout, command_line_options
from paratrain.training.config import DEFAULT_RECIPE, TrainConfig
from paratrain.training.mlflow_logger import DEFAULT_URI, require_mlflow
from paratrain.utils import environment
from paratrain.utils.catalog import RECIPES, STRATEGIES
from paratrain.utils.errors import UserError

if TYPE_CHECKING:  # `paratrain train --help` builds this parser without importing torch
    from paratrain.runtime.facade import Runtime
    from paratrain.training.loop import Summary


def _strategy_help() -> str:
    lines = ["auto (ddp under torchrun or on 2+ GPUs, else cuda, mps, cpu)"]
    lines += [f"{name} ({text})" for name, text in STRATEGIES.items()]
    return "; ".join(lines)


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """The options every command that trains a recipe shares; the runtime's are checked
    against their declarations (paratrain.runtime.config) by tests/test_config_agreement.py,
    and those declared with their argparse form are generated from them."""
    p.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help=f"one of: {', '.join(RECIPES)}, or hf:CONFIG (a Hugging Face config.json, its "
        "folder, or a model type such as gpt2), or timm:NAME (a timm image model such as "
        "vit_tiny_patch16_224 or resnet18)",
    )
    p.add_argument("--strategy", default="auto", help=_strategy_help())
    p.add_argument("--devices", help="a count (2) or a list (0,1 / cuda:0,cuda:1 / cpu,cpu)")
    p.add_argument("--epochs", type=int, help="default: the recipe's")
    p.add_argument(
        "--batch-size",
        type=int,
        help="batch size (global unless --batch-size-per process); default: the recipe's",
    )
    p.add_argument(
        "--batch-size-per",
        choices=("global", "process"),
        help="what --batch-size counts: the global batch (default; the same model on every "
        "layout) or each process's (as DDP, Horovod and Accelerate scripts mean it)",
    )
    p.add_argument("--lr", type=float, help="learning rate; default: the recipe's")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the initial weights, the data order and any random data (default 0)",
    )
    p.add_argument("--precision", default="32", help="32, bf16 or fp16")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--sync-batchnorm", action="store_true", help="BatchNorm -> SyncBatchNorm")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="the same weights run after run: deterministic GPU algorithms, no TF32, and "
        "the quiet machine's CPU thread count whatever the load (slower)",
    )
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="intra-op threads of each process (default: the cores other work leaves free "
        "when the run starts / processes)",
    )
    p.add_argument("--data-dir", help="directory with the CIFAR-10 python batches")
    p.add_argument(
        "--download",
        action="store_true",
        help="fetch CIFAR-10 into --data-dir (default ~/.cache/paratrain/cifar10) if absent",
    )
    p.add_argument("--synthetic", type=int, metavar="N", help="N random CIFAR-shaped images")
    p.add_argument("--cifar-stem", action="store_true", help="ResNet with a 3x3 stem, no max-pool")
    p.add_argument(
        "--compile",
        nargs="?",
        const="auto",
        metavar="MODE",
        help="torch.compile the model, its first step's gradients checked against eager "
        "(a disagreement falls back to eager); MODE: default, reduce-overhead, max-autotune, "
        "max-autotune-no-cudagraphs (default: reduce-overhead on one CUDA GPU, else default), "
        "or strict (the default mode; a disagreement is an error)",
    )
    p.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        help="channels-last memory format (default: on for convolutional models on CUDA)",
    )
    p.add_argument(
        "--fsdp-blocks",
        metavar="NAMES",
        help="fsdp: class or module names (comma-separated) sharded as one unit each; "
        "default: the model's repeated layers",
    )
    p.add_argument(
        "--pipeline-split",
        metavar="NAMES",
        help="pipeline: the modules (comma-separated) that start stages 2, 3, ..., e.g. "
        "blocks.2; default: the repeated layers, balanced by parameter count",
    )
    p.add_argument(
        "--pipeline-schedule",
        choices=("1f1b", "gpipe"),
        help="pipeline: the schedule of the micro-batches (default 1f1b)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=None,
        help="each block (fsdp's and pipeline's) recomputes its activations in the backward: "
        "less memory, one more forward per step; the same weights",
    )
    p.add_argument(
        "--oom",
        choices=("auto", "off"),
        help="auto (default): a micro-batch that runs out of memory is redone in halves, the "
        "same step; off: the run stops",
    )
    p.add_argument(
        "--pipeline-microbatches",
        type=int,
        metavar="N",
        help="pipeline: micro-batches per batch (default 4; fewer where a batch does not "
        "split evenly)",
    )
    for flag, kwargs in command_line_options():  # generated from their declarations
        p.add_argument(flag, **kwargs)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a built-in recipe",
        description=(
            "Train a built-in recipe (paratrain recipes) with the chosen strategy and devices. "
            "Every option is checked before any process starts; the run directory (--out) "
            "gets model.safetensors, config.json, metrics.jsonl and checkpoints/, and the "
            "same command on a run that was stopped continues it."
        ),
    )
    add_training_arguments(p)
    p.add_argument("--out", help="output directory; default runs/<recipe>-<timestamp>")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start over even if --out holds this run (which is otherwise continued); the "
        "old run directory is renamed OUT.before-<time>",
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run in DIR from its newest checkpoint (or DIR/checkpoints/step-N)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_run_arguments(p)
    add_launch_arguments(p)
    # Every option left out stays None, so that --resume knows which ones were given.
    p.set_defaults(handler=run, **dict.fromkeys(_OPTION_FIELDS))


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """What a run writes and how it feeds its steps: `paratrain train`'s, and every trial's
    of `paratrain tune`."""
    p.add_argument(
        "--save-every", type=int, metavar="N", help="also checkpoint every N optimizer steps"
    )
    p.add_argument("--keep", type=int, metavar="K", help="keep the newest K checkpoints (3)")
    p.add_argument(
        "--data-path",
        metavar="PATH",
        help="how batches are made: auto (default), loader, batched, device (same batches)",
    )
    p.add_argument(
        "--device-budget-gib",
        type=float,
        metavar="GIB",
        help="data the device path may copy to each device (default: 1/4 of its free memory)",
    )
    p.add_argument("--tensorboard", action="store_true", help="log metrics into OUT/tensorboard/")
    p.add_argument(
        "--mlflow",
        nargs="?",
        const=DEFAULT_URI,
        metavar="URI",
        help="log params, metrics and the final weights to MLflow (a tracking URI or a "
        "folder; default ./mlruns); needs paratrain[mlflow]",
    )
    p.add_argument(
        "--profile",
        type=int,
        metavar="STEPS",
        help="write a torch profiler trace of STEPS steps (after one warm-up step) into "
        "OUT/profile/ (TensorBoard, Perfetto)",
    )


#: TrainConfig fields set by the option of the same name, and the runtime's options whose
#: flags are generated from their declarations (TrainConfig carries them without a field)
_OPTION_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(TrainConfig)
    if f.name not in ("progress", "resume_from", "runtime_options")
) + tuple(
    kwargs["dest"]
    for _, kwargs in command_line_options()
    if kwargs["dest"] not in {f.name for f in dataclasses.fields(TrainConfig)}
)


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields set on the command line (an option left out is None)."""
    given = {name: getattr(args, name, None) for name in _OPTION_FIELDS}
    given = {name: value for name, value in given.items() if value is not None}
    if getattr(args, "no_progress", False):
        given["progress"] = False
    if getattr(args, "skip_nonfinite", False):
        given["nonfinite"] = "skip"
    return given


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig.of(**given_options(args))


def train_in_process(rt: Runtime, cfg: TrainConfig, directory: str | None) -> Summary:
    from paratrain.launching.launch import launched, on_main
    from paratrain.training import rundir
    from paratrain.training.loop import train

    if directory is None:
        # Started by torchrun: every process runs this command; the main one alone checks
        # and creates --out, so the overwrite check cannot race.
        directory = str(on_main(rt, rundir.prepare, cfg.out, cfg.recipe, cfg.overwrite))
        cfg.out = directory
    if cfg.download and launched():  # torchrun: the main process downloads, the others wait
        cfg.data_dir = on_main(rt, fetch_data, cfg)
    summary = train(rt, cfg, Path(directory))
    rt.print(summary.line(Path(directory)))
    return summary


def fetch_data(cfg: TrainConfig) -> str:
    """``--download``: the folder holding the recipe's data, fetched there if absent."""
    from paratrain.training.recipes import get_recipe

    fetch = get_recipe(cfg.recipe).download_data
    assert fetch is not None  # checked by TrainConfig.resolved
    return fetch(cfg.data_dir)


def train_command(cfg: TrainConfig) -> int:
    from paratrain.launching.launch import launched
    from paratrain.runtime.facade import Runtime
    from paratrain.training import rundir
    from paratrain.training.recipes import get_recipe
    from paratrain.training.tensorboard_logger import require_tensorboard

    cfg = cfg.resolved(get_recipe)
    if cfg.tensorboard:
        require_tensorboard()
    if cfg.mlflow is not None:
        require_mlflow()
    if cfg.download and not launched():  # once, before any process starts
        cfg.data_dir = fetch_data(cfg)
    directory = None
    if cfg.resume_from is not None:
        directory = cfg.out  # the run being continued, checked by resume_config
    elif not launched():
        directory = str(rundir.prepare(cfg.out, cfg.recipe, cfg.overwrite))
        cfg.out = directory
    rt = Runtime.from_config(cfg.runtime_config())
    if not launched() and rt.strategy.num_processes > 1:
        say_note(started_note(rt.threads, rt.strategy.num_processes))
    rt.launch(train_in_process, cfg, directory)
    return 0


def _sets_up_out(nodes: Nodes) -> bool:
    """Whether this process prepares --out: machine 0's launcher, or rank 0 under torchrun."""
    from paratrain.launching.launch import launched

    if launched():
        return environment.current().is_rank_zero
    return nodes.node_rank == 0


def run(args: argparse.Namespace) -> int:
    from paratrain.training import run_lock
    from paratrain.training.resume import resume_config

    nodes_from_args(args)  # the launch options are checked first
    check_hang_timeout(args.hang_timeout)
    directory = _run_directory(args)  # gives --out its default before the config is built
    if getattr(args, "resume", None) is not None:
        if getattr(args, "fresh", False):
            raise UserError("--resume continues a run; --fresh would start over: drop one")
        if directory is not None:  # a run another process writes: said before reading it
            run_lock.refuse_if_held(directory)
        cfg = resume_config(args.resume, given_options(args))
    else:
        cfg = config_from_args(args)
    processes = cfg.runtime_config().num_processes
    nodes, tasks = slurm_nodes(args, processes)  # under srun, SLURM's environment decides
    # One process writes a run directory at a time: this launcher (machine 0's), or rank 0
    # of a launcher that started every process with this command (torchrun, srun).
    locks = directory is not None and nodes.node_rank == 0 and environment.current().is_rank_zero
    with run_lock.hold(directory) if locks and directory else contextlib.nullcontext():
        return _run_locked(args, cfg, nodes, tasks)


def _run_locked(
    args: argparse.Namespace, cfg: TrainConfig, nodes: Nodes, tasks: SlurmTasks | None
) -> int:
    from paratrain.launching.launch import launched
    from paratrain.training.autoresume import plan, set_aside
    from paratrain.training.elastic import start_agent

    if cfg.resume_from is None and getattr(args, "fresh", False):
        if _sets_up_out(nodes):
            set_aside(cfg.out)
    elif cfg.resume_from is None:
        planned = plan(cfg, given_options(args))
        if planned is None:
            return 0  # this run, finished: nothing to do
        cfg = planned
    try:
        if nodes.uses_agent and not launched():
            return start_agent(cfg, nodes)  # several machines or restarts: torchrun's agent
        return train_command(cfg)
    except Stopped as stop:
        requeue_on_stop(args, tasks, stop)
        raise


def _run_directory(args: argparse.Namespace) -> Path | None:
    """The directory this command writes (``--out`` is given its default here); None for
    a ``--resume`` of nothing (refused later)."""
    from paratrain.checkpoints.state import CHECKPOINTS
    from paratrain.training import rundir

    if getattr(args, "resume", None) is not None:
        given = Path(args.resume)
        run = given.parent.parent if given.parent.name == CHECKPOINTS else given
        return run if run.is_dir() else None
    if args.out is None:
        args.out = str(rundir.default_out(args.recipe or DEFAULT_RECIPE))
    return Path(args.out)
