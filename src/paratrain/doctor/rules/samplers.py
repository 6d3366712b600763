"""DistributedSampler mistakes: the same shuffle every epoch, DDP without one, and
evaluation that counts its padded duplicates."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from paratrain.doctor.names import DATA_LOADER, DDP, DISTRIBUTED_SAMPLER, dotted
from paratrain.doctor.rules.base import Hit, Rule
from paratrain.doctor.script import (
    LOOPS,
    Script,
    has_kwargs_splat,
    identifiers,
    keyword,
    own_nodes,
)

_EVAL_WORDS = {"val", "valid", "validation", "test", "testing", "eval", "evaluation", "dev"}
_EVAL_FUNCTIONS = re.compile(r"^(eval|valid|test)", re.IGNORECASE)
#: helpers of libraries that shard a plain DataLoader themselves
_SHARDING_HELPERS = {"setup_loader", "prepare", "prepare_data_loader", "setup_dataloaders"}


def _set_epoch(script: Script) -> Iterator[Hit]:
    # Any set_epoch call anywhere (through loader.sampler, a helper...) counts as done.
    if any(True for _ in script.method_calls("set_epoch")):
        return
    for call in script.calls(DISTRIBUTED_SAMPLER):
        shuffle = keyword(call, "shuffle", 3)
        if has_kwargs_splat(call) or (shuffle is not None and not _is_true(shuffle)):
            continue
        if _evaluation(script, call):
            continue  # the order of evaluation does not matter; eval-distributed-sampler says more
        yield Hit(
            call,
            "DistributedSampler without set_epoch: every epoch repeats the same shuffle",
            "call sampler.set_epoch(epoch) at the start of every epoch (paratrain's "
            "rt.setup_loader(loader) shuffles anew every epoch by itself)",
        )


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _assigned_name(script: Script, node: ast.AST) -> str | None:
    parent = script.parents.get(node)
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
        return dotted(parent.targets[0])
    return None


def _passed_to_sharding_helper(script: Script, loader: ast.Call) -> bool:
    name = _assigned_name(script, loader)
    for helper in _SHARDING_HELPERS:
        for call in script.method_calls(helper):
            for arg in call.args:
                if arg is loader or (name is not None and dotted(arg) == name):
                    return True
    return False


def training_loops(script: Script) -> list[ast.For | ast.AsyncFor | ast.While]:
    """Loops whose body computes a backward pass."""
    loops = []
    for node in ast.walk(script.tree):
        if isinstance(node, LOOPS):
            body = ast.Module(body=node.body, type_ignores=[])
            if any(
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "backward"
                for n in ast.walk(body)
            ):
                loops.append(node)
    return loops


def _ddp_without_sampler(script: Script) -> Iterator[Hit]:
    if not any(True for _ in script.calls(DDP)):
        return
    if any(True for _ in script.calls(DISTRIBUTED_SAMPLER)) or any(
        "DistributedSampler" in name or "Sampler" in name for name in script.imports
    ):
        return
    trained = [loop for loop in training_loops(script) if isinstance(loop, ast.For | ast.AsyncFor)]
    for loader in script.calls(DATA_LOADER):
        if has_kwargs_splat(loader) or keyword(loader, "sampler", 3) is not None:
            continue
        if keyword(loader, "batch_sampler", 4) is not None:
            continue
        if _passed_to_sharding_helper(script, loader):
            continue
        shuffle = keyword(loader, "shuffle", 2)
        name = _assigned_name(script, loader)
        iterated = name is not None and any(name in _names_in(loop.iter) for loop in trained)
        if (shuffle is not None and _is_true(shuffle)) or iterated:
            yield Hit(
                loader,
                "DistributedDataParallel without a DistributedSampler: every process trains "
                "on the whole data set, the same batches N times",
                "build the loader with sampler=DistributedSampler(dataset) (and call "
                "set_epoch each epoch), or pass it through paratrain's rt.setup_loader",
            )


def _names_in(node: ast.AST) -> set[str]:
    return {d for n in ast.walk(node) if (d := dotted(n)) is not None}


def _tokens(name: str) -> set[str]:
    return {t.lower() for t in re.split(r"[^A-Za-z0-9]+|_", name) if t}


def _looks_like_evaluation(script: Script, names: set[str], dataset: ast.expr | None) -> bool:
    if any(_tokens(n) & _EVAL_WORDS for n in names):
        return True
    if dataset is not None:
        calls = [dataset] if isinstance(dataset, ast.Call) else []
        if isinstance(dataset, ast.Name):
            calls += [
                value
                for target, value, _ in _all_assignments(script)
                if target == dataset.id and isinstance(value, ast.Call)
            ]
        for call in calls:
            train = keyword(call, "train")
            if isinstance(train, ast.Constant) and train.value is False:
                return True
            split = keyword(call, "split")
            if isinstance(split, ast.Constant) and _tokens(str(split.value)) & _EVAL_WORDS:
                return True
    return False


def _all_assignments(script: Script) -> Iterator[tuple[str, ast.expr, ast.Assign]]:
    yield from script.assignments(script.tree)
    for defs in script.functions().values():
        for function in defs:
            yield from script.assignments(function)


def _iterated_without_grad(script: Script, loader: ast.Call, loader_name: str) -> bool:
    """The loader is iterated (in the function that built it) under torch.no_grad(), or in an
    eval*/valid*/test* function."""
    for node in own_nodes(script.scope(loader)):
        if not isinstance(node, ast.For | ast.AsyncFor) or loader_name not in _names_in(node.iter):
            continue
        for parent in script.ancestors(node):
            if isinstance(parent, ast.With) and any(
                script.full_name(item.context_expr.func)
                in ("torch.no_grad", "torch.inference_mode")
                for item in parent.items
                if isinstance(item.context_expr, ast.Call)
            ):
                return True
            if isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef) and _EVAL_FUNCTIONS.match(
                parent.name
            ):
                return True
    return False


def _evaluation(script: Script, sampler: ast.Call) -> bool:
    """Whether the loader this sampler feeds evaluates rather than trains."""
    sampler_name = _assigned_name(script, sampler)
    names = {sampler_name} if sampler_name else set()
    dataset = keyword(sampler, "dataset", 0)
    if dataset is not None and (d := dotted(dataset)) is not None:
        names.add(d)
    loaders = {
        loader: _assigned_name(script, loader)
        for loader in script.calls(DATA_LOADER)
        if script.scope(loader) is script.scope(sampler)
        and any(
            (arg := keyword(loader, kw, pos)) is not None
            and (arg is sampler or (sampler_name is not None and sampler_name in identifiers(arg)))
            for kw, pos in (("sampler", 3), ("batch_sampler", 4))
        )
    }
    names |= {n for n in loaders.values() if n is not None}
    return _looks_like_evaluation(script, names, dataset) or any(
        _iterated_without_grad(script, loader, name)
        for loader, name in loaders.items()
        if name is not None
    )


def _evaluation_sampler(script: Script) -> Iterator[Hit]:
    for sampler in script.calls(DISTRIBUTED_SAMPLER):
        if _evaluation(script, sampler):
            yield Hit(
                sampler,
                "evaluation under a DistributedSampler: it pads the data so that every "
                "process gets as many samples, and the metrics count those duplicates",
                "evaluate with a split that shows each sample once (paratrain's "
                "rt.setup_loader(loader, evaluation=True)), or on rank 0 alone with a plain "
                "DataLoader",
            )


RULES = [
    Rule("set-epoch", "DistributedSampler without set_epoch each epoch", _set_epoch),
    Rule(
        "ddp-without-sampler",
        "DDP training loader without a DistributedSampler",
        _ddp_without_sampler,
    ),
    Rule("eval-distributed-sampler", "evaluation under a DistributedSampler", _evaluation_sampler),
]
