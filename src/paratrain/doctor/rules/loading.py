"""DataLoader settings that starve a GPU: loading in the training process, pageable memory."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.doctor.hints import uses_cuda
from paratrain.doctor.names import DATA_LOADER, TENSOR_DATASET, dotted
from paratrain.doctor.rules.base import Hit, Rule
from paratrain.doctor.script import Script, has_kwargs_splat, keyword


def _in_memory(script: Script, dataset: ast.expr | None) -> bool:
    """A TensorDataset: its batches are slices of tensors already in memory, which worker
    processes do not speed up (and which may already be on the GPU)."""
    if dataset is None:
        return False
    if isinstance(dataset, ast.Call):
        return script.full_name(dataset.func) == TENSOR_DATASET
    name = dotted(dataset)
    return any(
        isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and script.full_name(n.value.func) == TENSOR_DATASET
        and any(dotted(t) == name for t in n.targets)
        for n in ast.walk(script.tree)
    )


def _paratrain_loader(script: Script, loader: ast.Call) -> bool:
    """Passed to ``rt.setup_loader``, which pins memory on CUDA by itself."""
    parent = script.parents.get(loader)
    name = dotted(parent.targets[0]) if isinstance(parent, ast.Assign) else None
    return any(
        any(arg is loader or (name is not None and dotted(arg) == name) for arg in call.args)
        for call in script.method_calls("setup_loader")
    )


def _cuda_loaders(script: Script) -> Iterator[ast.Call]:
    if not uses_cuda(script):
        return
    for loader in script.calls(DATA_LOADER):
        if not has_kwargs_splat(loader) and not _in_memory(script, keyword(loader, "dataset", 0)):
            yield loader


def _is_constant(node: ast.expr | None, value: object) -> bool:
    return (
        isinstance(node, ast.Constant) and node.value == value and type(node.value) is type(value)
    )


def _num_workers(script: Script) -> Iterator[Hit]:
    for loader in _cuda_loaders(script):
        workers = keyword(loader, "num_workers", 5)
        if workers is None or _is_constant(workers, 0):
            yield Hit(
                loader,
                "DataLoader with num_workers=0 feeding a GPU: batches are loaded and "
                "transformed in the training process while the GPU waits",
                "pass num_workers=N (a few per GPU, e.g. 4) so worker processes prepare batches",
            )


def _pin_memory(script: Script) -> Iterator[Hit]:
    for loader in _cuda_loaders(script):
        pinned = keyword(loader, "pin_memory", 7)
        if (pinned is None or _is_constant(pinned, False)) and not _paratrain_loader(
            script, loader
        ):
            yield Hit(
                loader,
                "DataLoader without pin_memory feeding a GPU: every batch is copied from "
                "pageable memory, slower, and .to(device, non_blocking=True) cannot overlap it",
                "pass pin_memory=True (paratrain's rt.setup_loader pins on CUDA by itself)",
            )


RULES = [
    Rule("loader-workers", "num_workers=0 with CUDA", _num_workers),
    Rule("loader-pin-memory", "no pin_memory with CUDA", _pin_memory),
]
