"""DataLoader settings that starve a GPU: loading in the training process, pageable memory."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor.hints import uses_cuda
from paratrain.tools.doctor.names import DATA_LOADER, TENSOR_DATASET, dotted
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.rules.placement import FACTORIES as _FACTORIES
from paratrain.tools.doctor.script import Script, has_kwargs_splat, keyword


def _tensor_dataset(script: Script, dataset: ast.expr | None) -> ast.Call | None:
    """The ``TensorDataset(...)`` call the loader reads, if it reads one."""
    if dataset is None:
        return None
    if isinstance(dataset, ast.Call):
        return dataset if script.full_name(dataset.func) == TENSOR_DATASET else None
    name = dotted(dataset)
    for value, _ in script.assigned.get(name or "", []):
        if isinstance(value, ast.Call) and script.full_name(value.func) == TENSOR_DATASET:
            return value
    return None


def _on_device(script: Script, dataset: ast.Call) -> bool:
    """A TensorDataset of tensors that may already be on the device (``device=``,
    ``.cuda()``, ``.to(...)``, or anything not built here): pinning them would fail."""
    for tensor in dataset.args:
        if (
            isinstance(tensor, ast.Call)
            and script.full_name(tensor.func) in _FACTORIES
            and keyword(tensor, "device") is None
            and not has_kwargs_splat(tensor)
        ):
            continue
        return True
    return not dataset.args


def _helper_loaders(script: Script) -> set[int]:
    """Loaders passed to ``rt.setup_loader``, which pins memory on CUDA by itself."""
    passed: set[int] = set()
    names: set[str] = set()
    for call in script.method_calls("setup_loader"):
        for arg in call.args:
            passed.add(id(arg))
            if (name := dotted(arg)) is not None:
                names.add(name)
    for loader in script.calls(DATA_LOADER):
        parent = script.parents.get(loader)
        if isinstance(parent, ast.Assign) and dotted(parent.targets[0]) in names:
            passed.add(id(loader))
    return passed


def _cuda_loaders(script: Script, pinning: bool) -> Iterator[ast.Call]:
    """Loaders feeding CUDA: the script names CUDA, or the loader pins its batches (pinned
    memory is for copies to a GPU). A TensorDataset's batches are slices of tensors already
    in memory: worker processes do not speed them up, but pinning them does (when they are
    plain CPU tensors built here)."""
    cuda = uses_cuda(script)
    for loader in script.calls(DATA_LOADER):
        if has_kwargs_splat(loader):
            continue
        if not cuda and not _is_constant(keyword(loader, "pin_memory", 7), True):
            continue
        dataset = _tensor_dataset(script, keyword(loader, "dataset", 0))
        if dataset is not None and (not pinning or _on_device(script, dataset)):
            continue
        yield loader


def _is_constant(node: ast.expr | None, value: object) -> bool:
    return (
        isinstance(node, ast.Constant) and node.value == value and type(node.value) is type(value)
    )


#: libraries whose data sets read and decode every sample (files, images, audio...)
_LOADING_LIBRARIES = ("torchvision.", "torchaudio.", "torchtext.", "datasets.", "webdataset.")


def _loads_samples(script: Script, dataset: ast.expr | None) -> bool:
    """The data set is known to do work per sample: built by a library that reads and
    decodes files (torchvision's ImageFolder, CIFAR10...). Anything else (a parameter, a
    class of another module, tensors in memory) may cost nothing to index, so no finding."""
    if dataset is None:
        return False
    values = [dataset]
    if (name := dotted(dataset)) is not None:
        values += [v for v, _ in script.assigned.get(name, [])]
    for value in values:
        if isinstance(value, ast.Call):
            full = script.full_name(value.func) or ""
            if full.startswith(_LOADING_LIBRARIES):
                return True
    return False


def _num_workers(script: Script) -> Iterator[Hit]:
    for loader in _cuda_loaders(script, pinning=False):
        if not _loads_samples(script, keyword(loader, "dataset", 0)):
            continue
        workers = keyword(loader, "num_workers", 5)
        if workers is None or _is_constant(workers, 0):
            yield Hit(
                loader,
                "DataLoader with num_workers=0 feeding a GPU: batches are loaded and "
                "transformed in the training process while the GPU waits",
                "pass num_workers=N (a few per GPU, e.g. 4) so worker processes prepare batches",
            )


def _pin_memory(script: Script) -> Iterator[Hit]:
    helped = _helper_loaders(script)
    for loader in _cuda_loaders(script, pinning=True):
        pinned = keyword(loader, "pin_memory", 7)
        if (pinned is None or _is_constant(pinned, False)) and id(loader) not in helped:
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
