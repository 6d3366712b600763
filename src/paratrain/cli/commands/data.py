"""`paratrain data shard`: a recipe's data written as tar shards, for `train --data-dir`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from paratrain.training.config import DEFAULT_RECIPE

#: samples per shard unless told
SAMPLES_PER_SHARD = 256


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "data",
        help="write a recipe's data as tar shards",
        description="Data that does not fit in memory: write a recipe's data as tar shards "
        "in WebDataset's format (with their lengths), which `paratrain train --data-dir DIR` "
        "then reads as a stream. Needs paratrain[stream].",
    )
    sub = parser.add_subparsers(dest="data_command", required=True, parser_class=type(parser))
    shard = sub.add_parser(
        "shard",
        help="write a recipe's train and test data as tar shards",
        description="Write the recipe's training and test data into OUT as tar shards "
        "(train-00000.tar, ..., test-00000.tar, ...) with their index (shards.json).",
    )
    shard.add_argument("--recipe", default=DEFAULT_RECIPE, help="the recipe whose data to write")
    shard.add_argument("--out", required=True, metavar="DIR", help="the folder to write into")
    shard.add_argument(
        "--samples-per-shard",
        type=int,
        default=SAMPLES_PER_SHARD,
        metavar="N",
        help=f"samples in each shard (default {SAMPLES_PER_SHARD})",
    )
    shard.add_argument(
        "--data-dir", metavar="DIR", help="where the recipe reads its data (cifar10-resnet18)"
    )
    shard.add_argument(
        "--synthetic", type=int, metavar="N", help="N random images (cifar10-resnet18)"
    )
    shard.add_argument("--seed", type=int, default=0, help="the seed of --synthetic data")
    shard.set_defaults(handler=run_shard)


@dataclass
class _Settings:
    """What a recipe's data builder reads."""

    data_dir: str | None
    synthetic: int | None
    seed: int
    lr: float | None = None
    cifar_stem: bool = True


def run_shard(args: argparse.Namespace) -> int:
    from paratrain.data.shards import write_shards
    from paratrain.training.recipes import get_recipe

    recipe = get_recipe(args.recipe)
    recipe.check_data_options(args.data_dir, args.synthetic)
    train, test = recipe.build_data(_Settings(args.data_dir, args.synthetic, args.seed))
    index = write_shards(args.out, {"train": train, "test": test}, args.samples_per_shard)
    print(
        f"wrote {len(train)} training and {len(test)} test samples of {recipe.name} as "  # type: ignore[arg-type]
        f"shards of {args.samples_per_shard} into {args.out} ({index.name})"
    )
    return 0
