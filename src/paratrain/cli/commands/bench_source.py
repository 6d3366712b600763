"""What `paratrain bench` and `paratrain bench loader` measure: a recipe or the user's model."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from paratrain.training.config import DEFAULT_RECIPE
from paratrain.utils.catalog import RECIPES
from paratrain.utils.errors import UserError

if TYPE_CHECKING:
    from paratrain.tools.bench.task import TaskSource


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """--recipe or --script, and the recipe's data options."""
    what = p.add_mutually_exclusive_group()
    what.add_argument("--recipe", help=f"one of: {', '.join(RECIPES)} (default digits)")
    what.add_argument(
        "--script",
        metavar="FILE.py:FACTORY",
        help="your model: FACTORY() returns (model, loss_fn, sample_batch[, make_optimizer])",
    )
    p.add_argument("--data-dir", help="directory with the CIFAR-10 python batches")
    p.add_argument("--synthetic", type=int, metavar="N", help="N random CIFAR-shaped images")


def source_from_args(args: argparse.Namespace) -> TaskSource:
    from paratrain.tools.bench.task import TaskSource

    if args.script is not None:
        if args.data_dir is not None or args.synthetic is not None:
            raise UserError("--data-dir and --synthetic are for recipes, not --script")
        return TaskSource(script=args.script, seed=args.seed)
    return TaskSource(
        recipe=args.recipe or DEFAULT_RECIPE,
        data_dir=args.data_dir,
        synthetic=args.synthetic,
        seed=args.seed,
    )
