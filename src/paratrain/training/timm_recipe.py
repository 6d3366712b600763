"""``--recipe timm:NAME``: a timm image model (``timm:vit_tiny_patch16_224``,
``timm:resnet18``, any name ``timm.list_models()`` gives) without pretrained weights and no
network, trained on the shipped 8x8 digits drawn at 32x32 pixels in three channels.

The model is built for 32x32 images where it takes an image size (a ``patch16`` ViT then
sees 2x2 patches), for the ten digit classes. timm initialises it
its own way, on the CPU, from the run's seed: every process and every layout starts from
the same weights (not on the meta device: timm's initialisation of a ViT's class token and
position embedding belongs to the whole model, not to a module).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from paratrain.training.recipe import Datasets, Params, Recipe, RecipeSettings
from paratrain.utils.errors import UserError

PREFIX = "timm:"
#: the pixels of a side of the images the recipe trains on
IMAGE_SIZE = 32
CLASSES = 10


def is_timm(name: str) -> bool:
    return name.startswith(PREFIX)


def timm_recipe(name: str) -> Recipe:
    """The recipe ``timm:NAME``, or ``UserError`` naming what is wrong with ``NAME``."""
    model_name = name.removeprefix(PREFIX)
    timm = _import_timm(name)
    if not model_name or not timm.is_model(model_name):
        raise UserError(
            f"--recipe {name}: timm has no model {model_name!r}; "
            "python -c \"import timm; print(timm.list_models('vit_*'))\" lists the names"
        )
    options = _sized_options(timm, model_name)

    def build_model(cfg: RecipeSettings) -> nn.Module:
        # on the CPU whatever device is current (the loop's meta device included): timm
        # initialises the whole model, from the run's seed
        with torch.device("cpu"), torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            return _create(timm, name, model_name, options)

    return Recipe(
        name=name,
        description=f"timm {model_name} (no pretrained weights, {IMAGE_SIZE}x{IMAGE_SIZE} "
        "images) on the shipped digits, AdamW",
        epochs=3,
        batch_size=64,
        lr=1e-3,
        build_model=build_model,
        build_data=_digits_at_size,
        build_optimizer=_adamw,
        build_loss=nn.CrossEntropyLoss,
    )


def _import_timm(name: str) -> Any:
    try:
        import timm
    except ImportError:
        raise UserError(
            f"--recipe {name} needs timm (which needs torchvision): pip install 'paratrain[timm]'"
        ) from None
    return timm


def _sized_options(timm: Any, model_name: str) -> dict[str, Any]:
    """timm's options for the model: 32x32 images where the model takes an image size
    (ViTs do, ResNets do not), ten classes; asked of the model built on the meta device."""
    options: dict[str, Any] = {"pretrained": False, "num_classes": CLASSES}
    sized = {**options, "img_size": IMAGE_SIZE}
    try:
        with torch.device("meta"):
            timm.create_model(model_name, **sized)
    except TypeError as error:
        if "img_size" in str(error):
            return options
    except Exception:  # the real build reports what the model refuses
        pass
    return sized


def _create(timm: Any, name: str, model_name: str, options: dict[str, Any]) -> nn.Module:
    try:
        model: nn.Module = timm.create_model(model_name, **options)
    except Exception as error:  # timm's models refuse sizes in their own ways
        first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise UserError(
            f"--recipe {name}: timm could not build {model_name} for {IMAGE_SIZE}x"
            f"{IMAGE_SIZE} images ({first}); try a ViT (timm:vit_tiny_patch16_224) or a "
            "ResNet (timm:resnet18)"
        ) from None
    return model


def _digits_at_size(cfg: RecipeSettings) -> Datasets:
    """The shipped digits (1,437 training and 360 test images) at 32x32 pixels, grey in
    three channels, scaled to [-1, 1]."""
    from paratrain.data.digits import load_digits_split

    def resized(data: TensorDataset) -> TensorDataset:
        images, labels = data.tensors
        large = nn.functional.interpolate(images, size=IMAGE_SIZE, mode="bilinear")
        return TensorDataset((large.expand(-1, 3, -1, -1) * 2 - 1).contiguous(), labels)

    train, test = load_digits_split()
    return resized(train), resized(test)


def _adamw(params: Params, cfg: RecipeSettings) -> torch.optim.Optimizer:
    assert cfg.lr is not None
    return torch.optim.AdamW(params, lr=cfg.lr)
