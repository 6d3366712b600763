"""Which submodules FSDP shards as one unit each ("blocks").

Each block's parameters are gathered just before it runs and freed right after, so the
peak holds one block's full parameters, not the model's. The default policy finds the
repeated layers of any model: walking down from the root, a child with parameters is a
block when its class repeats among its siblings (ResNet's ``layer1..4``) or when it is an
entry of an ``nn.Sequential``/``nn.ModuleList`` (a transformer's blocks); other children are
searched inside. Whatever no block holds (embeddings, final norm, head) belongs to the root.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch import nn

from paratrain.utils.errors import UserError


def has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def default_blocks(model: nn.Module) -> list[nn.Module]:
    blocks: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        children = [child for child in parent.children() if has_parameters(child)]
        counts = Counter(type(child) for child in children)
        container = isinstance(parent, (nn.Sequential, nn.ModuleList))
        for child in children:
            if container or counts[type(child)] >= 2:
                blocks.append(child)
            else:
                visit(child)

    visit(model)
    return blocks


def named_blocks(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The submodules whose class name or dotted module name is in ``names``."""
    found: list[nn.Module] = []
    matched: set[str] = set()
    for qualified, module in model.named_modules():
        if module is model or not has_parameters(module):
            continue
        for name in (type(module).__name__, qualified):
            if name in names:
                found.append(module)
                matched.add(name)
                break
    unknown = [name for name in names if name not in matched]
    if unknown:
        classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise UserError(
            f"--fsdp-blocks {','.join(unknown)}: no module of {type(model).__name__} with "
            f"parameters has that class or name; its classes: {', '.join(classes)}"
        )
    return found


def choose_blocks(model: nn.Module, names: Sequence[str] = ()) -> list[nn.Module]:
    """The blocks to shard, innermost first: fully_shard wants children before parents."""
    blocks = named_blocks(model, names) if names else default_blocks(model)
    # Innermost first: a block nested in another is sharded before its parent.
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(blocks, key=lambda m: -depth[id(m)])
