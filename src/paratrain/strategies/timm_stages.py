"""Pipeline stages of a timm ViT or ResNet built from its block list, not by tracing.

timm's ViT forward has control flow ``torch.fx`` cannot follow, but both families are a stem,
a list of blocks and a head. A ViT (``VisionTransformer``: ``vit_*``) is the patch embedding,
class/register tokens and position embedding, ``blocks.0`` ... ``blocks.N``, the final norm,
the pooling and the head; a ResNet is its stem (``conv1``, ``bn1``, ``act1``, ``maxpool``),
the blocks of ``layer1`` ... ``layer4`` (``layer1.0``, ``layer1.1``, ...), the global pool and
``fc``. Each stage holds some of the blocks, the first the stem too, the last the head, under
the model's own names, and its forward calls them as the model's own forward does.

Only these two classes are recognised (by their module and name): a subclass or another
family whose forward differs would train a different model. Where the model's forward calls
a helper that reads only the model's attributes (the ViT's ``_pos_embed`` and ``pool``), the
stage calls timm's own method on itself, holding the attributes it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.strategies.decoder_stages import attach

Tensor = torch.Tensor


@dataclass(frozen=True)
class ImageLayout:
    """Where a timm image model keeps its parts, as names under the model."""

    family: str
    #: the modules the first stage runs before its blocks, in order
    stem: tuple[str, ...]
    #: the ``nn.Sequential`` modules holding the blocks, in the order the model runs them
    containers: tuple[str, ...]
    #: the modules the last stage runs after its blocks
    head: tuple[str, ...]
    #: the model's own parameters (class token, position embedding), held by the first stage
    own: tuple[str, ...] = ()


VIT = ImageLayout(
    "vit",
    ("patch_embed", "pos_drop", "patch_drop", "norm_pre"),
    ("blocks",),
    ("norm", "attn_pool", "fc_norm", "head_drop", "head"),
    ("cls_token", "reg_token", "pos_embed"),
)
RESNET = ImageLayout(
    "resnet",
    ("conv1", "bn1", "act1", "maxpool"),
    ("layer1", "layer2", "layer3", "layer4"),
    ("global_pool", "fc"),
)

#: the classes whose forward :class:`ImageStage` writes out, by module and class name
_LAYOUTS = {
    "timm.models.vision_transformer.VisionTransformer": VIT,
    "timm.models.resnet.ResNet": RESNET,
}

#: plain attributes the stage copies from the model (what timm's helpers read)
_PLAIN = (bool, int, float, str, type(None))


def image_layout(model: nn.Module) -> ImageLayout | None:
    """The layout of ``model`` when it is a timm ViT or ResNet."""
    kind = type(model)
    layout = _LAYOUTS.get(f"{kind.__module__}.{kind.__name__}")
    if layout is None:
        return None
    modules = dict(model.named_modules())
    if not all(isinstance(modules.get(name), nn.Sequential) for name in layout.containers):
        return None
    return layout


def block_names(model: nn.Module, layout: ImageLayout) -> list[str]:
    """The blocks, in the order the model runs them: ``blocks.0`` ..., or ``layer1.0`` ..."""
    return [
        f"{container}.{name}"
        for container in layout.containers
        for name, _ in model.get_submodule(container).named_children()
    ]


def aliases(layout: ImageLayout, blocks: Sequence[str]) -> dict[str, str]:
    """A container named as a split point starts with its first block (``layer3``)."""
    return {
        container: next(b for b in blocks if b.startswith(container + "."))
        for container in layout.containers
        if any(b.startswith(container + ".") for b in blocks)
    }


def _present(model: nn.Module, names: Sequence[str]) -> list[str]:
    modules = dict(model.named_modules())
    return [name for name in names if isinstance(modules.get(name), nn.Module)]


def segment_weights(model: nn.Module, layout: ImageLayout) -> list[int]:
    """Parameters of each block; the first block counts the stem and the model's own
    parameters, the last the head."""

    def count(names: Sequence[str]) -> int:
        found = _present(model, names)
        return sum(p.numel() for name in found for p in model.get_submodule(name).parameters())

    weights = [count([name]) for name in block_names(model, layout)]
    own = [getattr(model, name, None) for name in layout.own]
    weights[0] += count(layout.stem) + sum(p.numel() for p in own if isinstance(p, nn.Parameter))
    weights[-1] += count(layout.head)
    return weights


def build_stages(model: nn.Module, layout: ImageLayout, starts: Sequence[int]) -> list[nn.Module]:
    """One stage per run of blocks: ``starts`` are the indices (after 0) where stages 2, 3,
    ... begin."""
    names = block_names(model, layout)
    bounds = [0, *starts, len(names)]
    count = len(bounds) - 1
    return [
        ImageStage(model, layout, names[bounds[i] : bounds[i + 1]], i == 0, i == count - 1)
        for i in range(count)
    ]


class ImageStage(nn.Module):
    """Some blocks of a timm ViT or ResNet, with the stem on the first stage and the head on
    the last, called as the model's forward calls them."""

    #: timm's class of the model: the stage calls its helpers (``_pos_embed``, ``pool``)
    _model_class: type[nn.Module]

    def __init__(
        self,
        model: nn.Module,
        layout: ImageLayout,
        blocks: Sequence[str],
        first: bool,
        last: bool,
    ) -> None:
        super().__init__()
        for key, value in vars(model).items():  # what the helpers read: plain values only
            if not key.startswith("_") and key != "training" and isinstance(value, _PLAIN):
                object.__setattr__(self, key, value)
        self.layout, self.first, self.last = layout, first, last
        self.block_names = list(blocks)
        object.__setattr__(self, "_model_class", type(model))
        names = list(blocks)
        if first:
            names = [*_present(model, layout.stem), *names]
            for key in layout.own:
                param = model._parameters.get(key)
                if param is not None:
                    self.register_parameter(key, param)
        if last:
            names += _present(model, layout.head)
        for name in names:
            attach(self, name, model.get_submodule(name))

    def forward(self, x: Tensor) -> Tensor:
        """Images (first stage) or the features the stage before returned; the next
        features, or (last stage) the logits."""
        if self.first:
            x = self._stem(x)
        for name in self.block_names:
            x = self.get_submodule(name)(x)
        return self._head(x) if self.last else x

    def _call(self, name: str, x: Tensor) -> Tensor:
        module: Callable[[Tensor], Tensor] = self.get_submodule(name)
        return module(x)

    def _stem(self, x: Tensor) -> Tensor:
        if self.layout.family == "vit":  # forward_features, up to the blocks
            x = self._call("patch_embed", x)
            x = self._helper("_pos_embed")(self, x)  # tokens, position embedding, pos_drop
            return self._call("norm_pre", self._call("patch_drop", x))
        for name in self.layout.stem:  # conv1, bn1, act1, maxpool
            x = self._call(name, x)
        return x

    def _head(self, x: Tensor) -> Tensor:
        if self.layout.family == "vit":  # forward_features' norm, then forward_head
            x = self._call("norm", x)
            x = self._helper("pool")(self, x)
            return self._call("head", self._call("head_drop", self._call("fc_norm", x)))
        x = self._call("global_pool", x)
        rate = float(getattr(self, "drop_rate", 0.0) or 0.0)
        if rate:  # as forward_head: dropout while the model trains
            x = nn.functional.dropout(x, p=rate, training=self.get_submodule("fc").training)
        return self._call("fc", x)

    def _helper(self, name: str) -> Callable[..., Tensor]:
        helper: Callable[..., Tensor] = getattr(self._model_class, name)
        return helper
