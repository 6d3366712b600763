"""Resolve the names a script uses to what they were imported as.

``import torch.distributed as dist`` makes ``dist.init_process_group`` resolve to
``torch.distributed.init_process_group``; ``from torch.utils.data.distributed import
DistributedSampler as DS`` makes ``DS`` resolve to its full name. Rules compare full names,
so no alias fools them, and a local function that happens to be called ``spawn`` is not
``torch.multiprocessing.spawn``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

#: full names that PyTorch exports under several paths, mapped to one spelling
_CANONICAL = {
    "torch.utils.data.DistributedSampler": "torch.utils.data.distributed.DistributedSampler",
    "torch.utils.data.dataloader.DataLoader": "torch.utils.data.DataLoader",
    "torch.utils.data.dataset.TensorDataset": "torch.utils.data.TensorDataset",
    "torch.nn.DataParallel": "torch.nn.parallel.DataParallel",
    "torch.nn.parallel.data_parallel.DataParallel": "torch.nn.parallel.DataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel": (
        "torch.nn.parallel.DistributedDataParallel"
    ),
    "torch.multiprocessing.spawn.spawn": "torch.multiprocessing.spawn",
    "torch.distributed.distributed_c10d.init_process_group": (
        "torch.distributed.init_process_group"
    ),
    "lightning.fabric.Fabric": "lightning_fabric.Fabric",
    "lightning.Fabric": "lightning_fabric.Fabric",
    "lightning_fabric.fabric.Fabric": "lightning_fabric.Fabric",
    "accelerate.accelerator.Accelerator": "accelerate.Accelerator",
}

DISTRIBUTED_SAMPLER = "torch.utils.data.distributed.DistributedSampler"
DATA_LOADER = "torch.utils.data.DataLoader"
TENSOR_DATASET = "torch.utils.data.TensorDataset"
DATA_PARALLEL = "torch.nn.parallel.DataParallel"
DDP = "torch.nn.parallel.DistributedDataParallel"
SPAWN = ("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes")
INIT_PROCESS_GROUP = "torch.distributed.init_process_group"
TORCH_SAVE = "torch.save"
ACCELERATOR = "accelerate.Accelerator"
FABRIC = "lightning_fabric.Fabric"
RUNTIME = "paratrain.Runtime"


def import_table(imports: Iterable[ast.Import | ast.ImportFrom]) -> dict[str, str]:
    """Local name -> the full name it was imported as (every import, at any depth)."""
    table: dict[str, str] = {}
    for node in imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    table[alias.asname] = alias.name
                else:  # `import torch.distributed` binds `torch`
                    top = alias.name.split(".")[0]
                    table[top] = top
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            # `from .utils import setup` -> ".utils.setup": a local module, never a library's
            module = "." * node.level + (node.module or "")
            dot = "" if module.endswith(".") else "."
            for alias in node.names:
                if alias.name != "*":
                    table[alias.asname or alias.name] = f"{module}{dot}{alias.name}"
    return table


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def canonical(name: str) -> str:
    return _CANONICAL.get(name, name)


def resolve(node: ast.AST, table: dict[str, str]) -> str | None:
    """The full name of ``node`` when its first name was imported, else None."""
    chain = dotted(node)
    if chain is None:
        return None
    first, _, rest = chain.partition(".")
    if first not in table:
        return None
    full = table[first] + ("." + rest if rest else "")
    return canonical(full)
