"""Which submodules FSDP shards as one unit each ("blocks").

Each block's parameters are gathered just before it runs and freed right after, so the
peak holds one block's full parameters, not the model's. The default policy finds the
repeated layers of any model: walking down from the root, a child with parameters is a
block when its class repeats among its siblings (ResNet's ``layer1..4``) or when it is an
entry of an ``nn.Sequential``/``nn.ModuleList`` (a transformer's blocks); other children are
searched inside. Whatever no block holds (embeddings, final norm, head) belongs to the root.
A model that names its own blocks (Hugging Face's ``_no_split_modules``: ``GPT2Block``,
``LlamaDecoderLayer``) gets those instead, as Accelerate's FSDP plugin does.

A module that shares a parameter with a module outside it (Hugging Face's tied word
embedding and language-model head: GPT-2's ``wte`` and ``lm_head``) is never a block of its
own: FSDP refuses a parameter managed by two units, and the root holds both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch import nn

from paratrain.utils.errors import UserError


def has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _uses(module: nn.Module) -> Counter[int]:
    """How many times each parameter is held in ``module`` (a tied one: several)."""
    return Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))


def shares_outside(module: nn.Module, everywhere: Counter[int]) -> bool:
    """Whether ``module`` holds a parameter that some module outside it holds too
    (``everywhere``: :func:`_uses` of the whole model)."""
    return any(everywhere[key] > count for key, count in _uses(module).items())


def default_blocks(model: nn.Module) -> list[nn.Module]:
    everywhere = _uses(model)
    declared = _declared_blocks(model)
    if declared:
        return [m for m in declared if not shares_outside(m, everywhere)]
    blocks: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        children = [child for child in parent.children() if has_parameters(child)]
        counts = Counter(type(child) for child in children)
        container = isinstance(parent, (nn.Sequential, nn.ModuleList))
        for child in children:
            if (container or counts[type(child)] >= 2) and not shares_outside(child, everywhere):
                blocks.append(child)
            else:
                visit(child)

    visit(model)
    return blocks


def _declared_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of the classes the model declares unsplittable (``_no_split_modules``,
    Hugging Face's), outermost only; none when it declares none or none is present."""
    names = getattr(model, "_no_split_modules", None)
    if not isinstance(names, (list, tuple, set)) or not names:
        return []
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # parents before their children
        if id(module) in inside or module is model or type(module).__name__ not in names:
            continue
        found.append(module)
        inside.update(id(part) for part in module.modules())
    return found


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
    everywhere = _uses(model)
    for module in found:
        if shares_outside(module, everywhere):
            name = next(n for n, m in model.named_modules() if m is module)
            raise UserError(
                f"--fsdp-blocks: {name} ({type(module).__name__}) shares a parameter with a "
                "module outside it (tied weights, such as a word embedding and the head): "
                "FSDP cannot shard it as a unit of its own; leave it out of --fsdp-blocks"
            )
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
