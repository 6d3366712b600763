"""What a recipe is: a model, its data, its optimizer and sensible defaults."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset

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
    #: a Hugging Face model's configuration: the run writes it beside its final weights
    #: (``RUN/hf/``), which ``from_pretrained`` then loads
    hugging_face_config: dict[str, Any] | None = None

    def check_data_options(
        self, data_dir: str | None, synthetic: int | None, download: bool = False
    ) -> None:
        if data_dir is not None and _holds_shards(data_dir):
            if synthetic is not None or download:
                raise UserError(f"{data_dir} holds shards: drop --synthetic and --download")
            return
        if not self.uses_data_dir and (data_dir is not None or synthetic is not None):
            raise UserError(
                f"recipe {self.name} uses its own data; --data-dir and --synthetic are for "
                "cifar10-resnet18, or --data-dir DIR for shards `paratrain data shard` wrote"
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

    def data(self, cfg: RecipeSettings) -> Datasets:
        """The recipe's data sets, or those of a folder of tar shards (``--data-dir``,
        written by ``paratrain data shard``): the training shards shuffled by the seed."""
        if cfg.data_dir is None or not _holds_shards(cfg.data_dir):
            return self.build_data(cfg)
        from paratrain.data.shards import ShardStream

        train = ShardStream.from_folder(cfg.data_dir, "train", shuffle=True, seed=cfg.seed)
        return train, ShardStream.from_folder(cfg.data_dir, "test")


def _holds_shards(data_dir: str) -> bool:
    from paratrain.data.shards import is_shard_folder

    return is_shard_folder(data_dir)
