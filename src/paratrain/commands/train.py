"""`paratrain train`: validate everything, prepare --out, then train in every process."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from paratrain import rundir
from paratrain.config import TrainConfig
from paratrain.loop import Summary, train
from paratrain.recipes import DEFAULT_RECIPE, recipe_names
from paratrain.runtime import Runtime
from paratrain.strategies import describe_strategies


def _strategy_help() -> str:
    lines = ["auto (cuda, else mps, else cpu)"]
    lines += [f"{name} ({text})" for name, text in describe_strategies().items()]
    return "; ".join(lines)


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """The options every command that trains a recipe shares."""
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"one of: {', '.join(recipe_names())}")
    p.add_argument("--strategy", default="auto", help=_strategy_help())
    p.add_argument("--devices", help="a count (2) or a list (0,1 / cuda:0,cuda:1 / cpu,cpu)")
    p.add_argument("--epochs", type=int, help="default: the recipe's")
    p.add_argument("--batch-size", type=int, help="global batch size; default: the recipe's")
    p.add_argument("--lr", type=float, help="learning rate; default: the recipe's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="32", help="32, bf16 or fp16")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--sync-batchnorm", action="store_true", help="BatchNorm -> SyncBatchNorm")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    p.add_argument("--data-dir", help="directory with the CIFAR-10 python batches")
    p.add_argument("--synthetic", type=int, metavar="N", help="N random CIFAR-shaped images")
    p.add_argument("--cifar-stem", action="store_true", help="ResNet with a 3x3 stem, no max-pool")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train a built-in recipe")
    add_training_arguments(p)
    p.add_argument("--out", help="output directory; default runs/<recipe>-<timestamp>")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        recipe=args.recipe,
        strategy=args.strategy,
        devices=args.devices,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        out=getattr(args, "out", None),
        overwrite=getattr(args, "overwrite", False),
        data_dir=args.data_dir,
        synthetic=args.synthetic,
        precision=args.precision,
        accumulate=args.accumulate,
        sync_batchnorm=args.sync_batchnorm,
        cifar_stem=args.cifar_stem,
        max_steps=args.max_steps,
        progress=not getattr(args, "no_progress", False),
    )


def train_in_process(rt: Runtime, cfg: TrainConfig, directory: str) -> Summary:
    summary = train(rt, cfg, Path(directory))
    rt.print(summary.line(Path(directory)))
    return summary


def train_command(cfg: TrainConfig) -> int:
    cfg = cfg.resolved()
    directory = rundir.prepare(cfg.out, cfg.recipe, cfg.overwrite)
    cfg.out = str(directory)
    rt = Runtime.from_config(cfg.runtime_config())
    rt.launch(train_in_process, cfg, str(directory))
    return 0


def run(args: argparse.Namespace) -> int:
    return train_command(config_from_args(args))
