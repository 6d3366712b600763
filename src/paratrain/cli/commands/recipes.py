"""`paratrain recipes`: the built-in recipes, from the registry."""

from __future__ import annotations

import argparse
import json
from typing import Any

from paratrain.training.config import DEFAULT_RECIPE


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "recipes",
        help="list the built-in recipes",
        description="The built-in recipes (paratrain train --recipe NAME): what each trains, "
        "and its default epochs, batch size and learning rate.",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from paratrain.training.recipes import get_recipe, recipe_names

    if args.json:
        print(json.dumps([_fields(name) for name in recipe_names()], indent=2))
        return 0
    for name in recipe_names():
        recipe = get_recipe(name)
        default = " (default)" if name == DEFAULT_RECIPE else ""
        print(f"{name}{default}: {recipe.description}")
        print(f"    epochs {recipe.epochs}, batch size {recipe.batch_size}, lr {recipe.lr}")
    print(
        "hf:CONFIG: a Hugging Face Transformers causal language model from a config.json (or "
        "its folder, or a model type such as gpt2), on a seeded token language; "
        "needs paratrain[hf]"
    )
    print(
        "timm:NAME: a timm image model by name (timm:vit_tiny_patch16_224, timm:resnet18), "
        "without pretrained weights, on the shipped digits at 32x32; needs paratrain[timm]"
    )
    return 0


def _fields(name: str) -> dict[str, Any]:
    from paratrain.training.recipes import get_recipe

    recipe = get_recipe(name)
    return {
        "name": name,
        "default": name == DEFAULT_RECIPE,
        "description": recipe.description,
        "epochs": recipe.epochs,
        "batch_size": recipe.batch_size,
        "lr": recipe.lr,
    }
