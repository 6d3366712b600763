"""Built-in recipes: a model, its data, its optimizer and sensible defaults, by name."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from paratrain.training.hugging_face_recipe import hugging_face_recipe, is_hugging_face
from paratrain.training.recipe import Datasets, Params, Recipe, RecipeSettings
from paratrain.training.timm_recipe import is_timm, timm_recipe
from paratrain.utils.errors import UserError

_RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    _RECIPES[recipe.name] = recipe
    return recipe


def recipe_names() -> list[str]:
    return list(_RECIPES)


def get_recipe(name: str) -> Recipe:
    if is_hugging_face(name):
        return hugging_face_recipe(name)
    if is_timm(name):
        return timm_recipe(name)
    try:
        return _RECIPES[name]
    except KeyError:
        valid = ", ".join([*_RECIPES, "hf:CONFIG", "timm:NAME"])
        raise UserError(f"unknown recipe {name!r}; valid recipes: {valid}") from None


# -- digits ------------------------------------------------------------------------------------
def _digits_model(cfg: RecipeSettings) -> nn.Module:
    from paratrain.models import DigitsCNN

    return DigitsCNN()


def _digits_data(cfg: RecipeSettings) -> Datasets:
    from paratrain.data.digits import load_digits_split

    return load_digits_split()


def _sgd_momentum(params: Params, cfg: RecipeSettings) -> torch.optim.Optimizer:
    assert cfg.lr is not None
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)


register_recipe(
    Recipe(
        name="digits",
        description="handwritten digits (1,797 8x8 images, shipped), small CNN, SGD",
        epochs=10,
        batch_size=32,
        lr=0.02,
        build_model=_digits_model,
        build_data=_digits_data,
        build_optimizer=_sgd_momentum,
        build_loss=nn.CrossEntropyLoss,
    )
)


# -- linear (seed 000) ------------------------------------------------------------------------
def _linear_data(cfg: RecipeSettings) -> Datasets:
    # Fixed data (not the run's seed): runs with different seeds learn the same problem.
    generator = torch.Generator().manual_seed(10)
    x = torch.randn(1200, 10, generator=generator)
    true_weight = torch.randn(10, 1, generator=generator)
    y = x @ true_weight + 0.1 * torch.randn(1200, 1, generator=generator)
    return TensorDataset(x[:1000], y[:1000]), TensorDataset(x[1000:], y[1000:])


def _sgd(params: Params, cfg: RecipeSettings) -> torch.optim.Optimizer:
    assert cfg.lr is not None
    return torch.optim.SGD(params, lr=cfg.lr)


register_recipe(
    Recipe(
        name="linear",
        description="nn.Linear(10, 1), MSE, SGD lr 0.01 on seeded random data",
        epochs=20,
        batch_size=10,
        lr=0.01,
        build_model=lambda cfg: nn.Linear(10, 1),
        build_data=_linear_data,
        build_optimizer=_sgd,
        build_loss=nn.MSELoss,
        classification=False,
    )
)


# -- cifar10-resnet18 (seed 004) ------------------------------------------------------------
def _resnet_model(cfg: RecipeSettings) -> nn.Module:
    from paratrain.models import resnet18

    return resnet18(num_classes=10, cifar_stem=cfg.cifar_stem)


def _cifar_data(cfg: RecipeSettings) -> Datasets:
    from paratrain.data.cifar import load_cifar10, synthetic_cifar10

    if cfg.synthetic is not None:
        return synthetic_cifar10(cfg.synthetic, seed=cfg.seed)
    assert cfg.data_dir is not None
    return load_cifar10(cfg.data_dir)


def _cifar_download(data_dir: str | None) -> str:
    from paratrain.data.download import download_cifar10

    return str(download_cifar10(data_dir, log=print))


def _sgd_resnet(params: Params, cfg: RecipeSettings) -> torch.optim.Optimizer:
    assert cfg.lr is not None
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=5e-4)


register_recipe(
    Recipe(
        name="cifar10-resnet18",
        description="ResNet-18 on CIFAR-10 (--data-dir or --synthetic N), SGD",
        epochs=3,
        batch_size=256,
        lr=0.01,
        build_model=_resnet_model,
        build_data=_cifar_data,
        build_optimizer=_sgd_resnet,
        build_loss=nn.CrossEntropyLoss,
        drop_last=True,
        uses_data_dir=True,
        download_data=_cifar_download,
    )
)


# -- tiny-gpt (models too big for one device) --------------------------------------------------
#: the recipe's model (vocabulary, width, depth, heads, context); benchmarks scale it up
GPT_VOCAB, GPT_WIDTH, GPT_DEPTH, GPT_HEADS, GPT_CONTEXT = 64, 64, 4, 4, 32


def _gpt_model(cfg: RecipeSettings) -> nn.Module:
    from paratrain.models import GPT

    return GPT(GPT_VOCAB, GPT_WIDTH, GPT_DEPTH, GPT_HEADS, GPT_CONTEXT)


def _gpt_data(cfg: RecipeSettings) -> Datasets:
    from paratrain.data.tokens import markov_tokens

    # Fixed data (not the run's seed), like the linear recipe.
    tokens = markov_tokens(1200, GPT_CONTEXT, GPT_VOCAB, seed=7)
    return torch.utils.data.Subset(tokens, range(1000)), torch.utils.data.Subset(
        tokens, range(1000, 1200)
    )


def _gpt_loss() -> nn.Module:
    from paratrain.models import TokenCrossEntropy

    return TokenCrossEntropy()


def _adamw(params: Params, cfg: RecipeSettings) -> torch.optim.Optimizer:
    assert cfg.lr is not None
    return torch.optim.AdamW(params, lr=cfg.lr)


register_recipe(
    Recipe(
        name="tiny-gpt",
        description="GPT-style transformer (4 blocks, width 64) on a seeded Markov-chain language",
        epochs=2,
        batch_size=32,
        lr=3e-3,
        build_model=_gpt_model,
        build_data=_gpt_data,
        build_optimizer=_adamw,
        build_loss=_gpt_loss,
        classification=False,
    )
)
