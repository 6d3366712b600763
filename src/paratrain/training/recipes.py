"""Built-in recipes: a model, its data, its optimizer and sensible defaults, by name."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from paratrain.utils.errors import UserError


class RecipeSettings(Protocol):
    """What a recipe's builders read of the run's settings (the training configuration)."""

    lr: float | None
    seed: int
    cifar_stem: bool
    data_dir: str | None
    synthetic: int | None


Params = Iterator[nn.Parameter]
Datasets = tuple[Dataset[Any], Dataset[Any]]


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    epochs: int
    batch_size: int
    lr: float
    build_model: Callable[[RecipeSettings], nn.Module]
    build_data: Callable[[RecipeSettings], Datasets]
    build_optimizer: Callable[[Params, RecipeSettings], torch.optim.Optimizer]
    build_loss: Callable[[], nn.Module]
    classification: bool = True
    drop_last: bool = False
    uses_data_dir: bool = False
    #: an LR scheduler, built from the optimizer before the runtime's setup and handed to
    #: it: stepped after every ``optimizer.step()``, it advances where gradients were applied
    build_scheduler: Callable[[torch.optim.Optimizer, RecipeSettings], Any] | None = None
    #: ``--download``: fetch the data into a folder (None: the default cache), return it
    download_data: Callable[[str | None], str] | None = None

    def check_data_options(
        self, data_dir: str | None, synthetic: int | None, download: bool = False
    ) -> None:
        if not self.uses_data_dir and (data_dir is not None or synthetic is not None):
            raise UserError(
                f"recipe {self.name} uses its own data; --data-dir and --synthetic are for "
                "cifar10-resnet18"
            )
        if download and self.download_data is None:
            raise UserError(f"recipe {self.name} has nothing to download; drop --download")
        if self.uses_data_dir and data_dir is None and synthetic is None and not download:
            raise UserError(
                f"recipe {self.name} needs data: --download (into --data-dir DIR or the cache), "
                "--data-dir DIR with the CIFAR-10 python batches, or --synthetic N for N "
                "random images"
            )
        if data_dir is not None and synthetic is not None:
            raise UserError("choose one of --data-dir and --synthetic")
        if download and synthetic is not None:
            raise UserError("choose one of --download and --synthetic")


_RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    _RECIPES[recipe.name] = recipe
    return recipe


def recipe_names() -> list[str]:
    return list(_RECIPES)


def get_recipe(name: str) -> Recipe:
    try:
        return _RECIPES[name]
    except KeyError:
        valid = ", ".join(_RECIPES)
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
