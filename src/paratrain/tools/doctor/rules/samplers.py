"""DistributedSampler mistakes: the same shuffle every epoch, DDP without one, and
evaluation that counts its padded duplicates."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from paratrain.tools.doctor.collectives import SHARDING_HELPERS
from paratrain.tools.doctor.escapes import acknowledged, escapes, evaluated_by_an_evaluator
from paratrain.tools.doctor.names import (
    ACCELERATOR,
    DATA_LOADER,
    DDP,
    DISTRIBUTED_SAMPLER,
    FABRIC,
    dotted,
)
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.rules.epochs import fixed_epoch
from paratrain.tools.doctor.script import (
    Script,
    has_kwargs_splat,
    identifiers,
    keyword,
)

_EVAL_WORDS = {"val", "valid", "validation", "test", "testing", "eval", "evaluation", "dev"}
_EVAL_FUNCTIONS = re.compile(r"^(eval|valid|test)", re.IGNORECASE)


def _set_epoch(script: Script) -> Iterator[Hit]:
    yield from fixed_epoch(script)
    # Any set_epoch call anywhere (through loader.sampler, a helper, a local module the
    # script imports...) counts as done.
    if any(any(True for _ in m.method_calls("set_epoch")) for m in script.modules):
        return
    loaders_by_scope = _loaders_by_scope(script)
    for call in script.calls(DISTRIBUTED_SAMPLER):
        shuffle = keyword(call, "shuffle", 3)
        if has_kwargs_splat(call) or (isinstance(shuffle, ast.Constant) and not _is_true(shuffle)):
            continue
        if _evaluation(script, call, loaders_by_scope):
            continue  # the order of evaluation does not matter; eval-distributed-sampler says more
        yield Hit(
            call,
            "DistributedSampler without set_epoch: every epoch repeats the same shuffle",
            "call sampler.set_epoch(epoch) at the start of every epoch (paratrain's "
            "rt.setup_loader(loader) shuffles anew every epoch by itself)",
            # handed to code doctor could not read (a trainer of another package), the
            # sampler may get its set_epoch there; a shuffle read from a config may be off
            (shuffle is None or _is_true(shuffle))
            and not escapes(script, _fed(script, call, loaders_by_scope)),
        )


def _fed(script: Script, sampler: ast.Call, loaders_by_scope: _LoaderIndex) -> set[str]:
    """The names of the sampler and of the loaders it feeds."""
    name = _assigned_name(script, sampler)
    keys: list[int | str] = [id(sampler), *([name] if name else [])]
    scope = id(script.scope(sampler))
    loaders = {
        _assigned_name(script, loader)
        for key in keys
        for loader in loaders_by_scope.get((scope, key), [])
    }
    return {n for n in [name, *loaders] if n is not None}


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _assigned_name(script: Script, node: ast.AST) -> str | None:
    parent = script.parents.get(node)
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
        return dotted(parent.targets[0])
    return None


def _sharded_by_helper(script: Script) -> tuple[set[int], set[str]]:
    """Loaders passed to a library helper that shards them: their ids, and their names."""
    ids: set[int] = set()
    names: set[str] = set()
    for helper in SHARDING_HELPERS:
        for call in script.method_calls(helper):
            for arg in call.args:
                ids.add(id(arg))
                if (name := dotted(arg)) is not None:
                    names.add(name)
    return ids, names


def training_loops(script: Script) -> list[ast.For | ast.AsyncFor | ast.While]:
    """Loops around a backward pass."""
    loops: dict[int, ast.For | ast.AsyncFor | ast.While] = {}
    for call in script.method_calls("backward"):
        for loop in script.loops_around(call):
            loops[id(loop)] = loop
    return list(loops.values())


def _ddp_without_sampler(script: Script) -> Iterator[Hit]:
    if not any(True for _ in script.calls(DDP)):
        return
    if any(True for _ in script.calls(DISTRIBUTED_SAMPLER)) or any(
        "DistributedSampler" in name or "Sampler" in name for name in script.imports
    ):
        return
    trained = [loop for loop in training_loops(script) if isinstance(loop, ast.For | ast.AsyncFor)]
    helped_ids, helped_names = _sharded_by_helper(script)
    for loader in script.calls(DATA_LOADER):
        if has_kwargs_splat(loader) or keyword(loader, "sampler", 3) is not None:
            continue
        if keyword(loader, "batch_sampler", 4) is not None:
            continue
        if id(loader) in helped_ids or _assigned_name(script, loader) in helped_names:
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
                for value, _ in script.assigned.get(dataset.id, [])
                if isinstance(value, ast.Call)
            ]
        for call in calls:
            train = keyword(call, "train")
            if isinstance(train, ast.Constant) and train.value is False:
                return True
            split = keyword(call, "split")
            if isinstance(split, ast.Constant) and _tokens(str(split.value)) & _EVAL_WORDS:
                return True
    return False


def _loops_over(script: Script, scope: ast.AST) -> dict[str, list[ast.For | ast.AsyncFor]]:
    """Name -> the for-loops of ``scope`` whose iterable mentions it (computed once)."""
    key = f"loops_over:{id(scope)}"
    if key not in script.memo:
        found: dict[str, list[ast.For | ast.AsyncFor]] = {}
        loops: list[ast.For | ast.AsyncFor] = [
            *script.own_of(scope, ast.For),
            *script.own_of(scope, ast.AsyncFor),
        ]
        for loop in loops:
            for name in _names_in(loop.iter):
                found.setdefault(name, []).append(loop)
        script.memo[key] = found
    over: dict[str, list[ast.For | ast.AsyncFor]] = script.memo[key]
    return over


def _iterated_without_grad(script: Script, loader: ast.Call, loader_name: str) -> bool:
    """The loader is iterated (in the function that built it) under torch.no_grad(), or in an
    eval*/valid*/test* function."""
    for node in _loops_over(script, script.scope(loader)).get(loader_name, []):
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


#: (scope, what the loader's sampler is: the sampler call's id, or a name it mentions)
_LoaderIndex = dict[tuple[int, int | str], list[ast.Call]]


def _loaders_by_scope(script: Script) -> _LoaderIndex:
    """Each loader, under its scope and each thing its sampler argument names: one pass, so
    that finding a sampler's loaders is a look-up (linear in the number of loaders)."""
    if "loaders_by_sampler" in script.memo:
        memo: _LoaderIndex = script.memo["loaders_by_sampler"]
        return memo
    found: _LoaderIndex = {}
    for loader in script.calls(DATA_LOADER):
        scope = id(script.scope(loader))
        for kw, pos in (("sampler", 3), ("batch_sampler", 4)):
            if (arg := keyword(loader, kw, pos)) is None:
                continue
            keys: set[int | str] = {id(arg), *identifiers(arg)}
            for key in keys:
                found.setdefault((scope, key), []).append(loader)
    script.memo["loaders_by_sampler"] = found
    return found


def _evaluation(script: Script, sampler: ast.Call, loaders_by_scope: _LoaderIndex) -> bool:
    """Whether the loader this sampler feeds evaluates rather than trains."""
    return _evaluated(script, sampler, loaders_by_scope) is not None


def _evaluated(
    script: Script, sampler: ast.Call, loaders_by_scope: _LoaderIndex
) -> set[str] | None:
    """The names of the evaluation loader this sampler feeds (and of the sampler), or None
    when it feeds training."""
    sampler_name = _assigned_name(script, sampler)
    names = {sampler_name} if sampler_name else set()
    dataset = keyword(sampler, "dataset", 0)
    if dataset is not None and (d := dotted(dataset)) is not None:
        names.add(d)
    scope = id(script.scope(sampler))
    keys: list[int | str] = [id(sampler), *([sampler_name] if sampler_name else [])]
    loaders = {
        loader: _assigned_name(script, loader)
        for key in keys
        for loader in loaders_by_scope.get((scope, key), [])
    }
    names |= {n for n in loaders.values() if n is not None}
    evaluates = _looks_like_evaluation(script, names, dataset) or any(
        _iterated_without_grad(script, loader, name)
        for loader, name in loaders.items()
        if name is not None
    )
    return names if evaluates else None


def _evaluation_sampler(script: Script) -> Iterator[Hit]:
    loaders_by_scope = _loaders_by_scope(script)
    for sampler in script.calls(DISTRIBUTED_SAMPLER):
        drop_last = keyword(sampler, "drop_last", 5)
        if isinstance(drop_last, ast.Constant) and drop_last.value is True:
            continue  # drops the tail instead of padding it (evaluated apart, if at all)
        names = _evaluated(script, sampler, loaders_by_scope)
        if names is None:
            continue
        # An evaluator of another module may drop the duplicates (by sample id), and a
        # script that warns of them knows: the metrics may be right
        sure = not (
            escapes(script, names)
            or evaluated_by_an_evaluator(script, names)
            or acknowledged(script, sampler, "duplicate")
        )
        yield Hit(
            sampler,
            "evaluation under a DistributedSampler: it pads the data so that every "
            "process gets as many samples, and the metrics count those duplicates",
            "evaluate with a split that shows each sample once (paratrain's "
            "rt.setup_loader(loader, evaluation=True)), or on rank 0 alone with a plain "
            "DataLoader",
            sure,
        )


def _evaluation_prepared(script: Script) -> Iterator[Hit]:
    """An evaluation loader prepared by Fabric (always padded by its DistributedSampler)
    or by Accelerate when the metrics are gathered with ``gather``, which keeps the
    duplicates (``gather_for_metrics`` drops them)."""
    fabrics = script.instances(FABRIC)
    accelerators = script.instances(ACCELERATOR)
    keeps_duplicates = any(
        isinstance(c.func, ast.Attribute) and dotted(c.func.value) in accelerators
        for c in script.method_calls("gather")
    ) and not any(True for _ in script.method_calls("gather_for_metrics"))
    trims = _trims_to_the_data_set(script)
    for helper, owners in (("setup_dataloaders", fabrics), ("prepare", accelerators)):
        if not owners or (helper == "prepare" and not keeps_duplicates):
            continue
        for call in script.method_calls(helper):
            if not isinstance(call.func, ast.Attribute) or dotted(call.func.value) not in owners:
                continue
            chosen = keyword(call, "use_distributed_sampler")
            if isinstance(chosen, ast.Constant) and chosen.value is False:
                continue
            parent = script.parents.get(call)
            targets: list[str | None] = []
            if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
                target = parent.targets[0]
                elements = target.elts if isinstance(target, ast.Tuple) else [target]
                targets = [dotted(e) for e in elements]
            for index, arg in enumerate(call.args):
                names = {dotted(arg), targets[index] if index < len(targets) else None}
                named = {n for n in names if n is not None}
                if named and _looks_like_evaluation(script, named, None):
                    what = ast.unparse(call.func)
                    yield Hit(
                        call,
                        f"{sorted(named)[0]} is evaluated through {what}, whose sampler pads "
                        "the data so that every process gets as many samples: the metrics "
                        "count those duplicates",
                        "Accelerate: accelerator.gather_for_metrics(...) drops them; Fabric: "
                        "use_distributed_sampler=False with a sampler that does not pad, or "
                        "trim to len(dataset); paratrain: rt.setup_loader(loader, "
                        "evaluation=True)",
                        sure=not trims,
                    )
                    break


def _trims_to_the_data_set(script: Script) -> bool:
    """``predictions[: len(loader.dataset) - seen]``, ``losses[: len(eval_dataset)]``: the
    script drops the padded duplicates itself."""
    return any(
        isinstance(node.slice, ast.Slice)
        and node.slice.upper is not None
        and any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "len"
            and n.args
            and "dataset" in (dotted(n.args[0]) or "").lower()
            for n in ast.walk(node.slice.upper)
        )
        for node in script.nodes(ast.Subscript)
    )


RULES = [
    Rule("set-epoch", "DistributedSampler without set_epoch each epoch", _set_epoch),
    Rule(
        "ddp-without-sampler",
        "DDP training loader without a DistributedSampler",
        _ddp_without_sampler,
    ),
    Rule("eval-distributed-sampler", "evaluation under a DistributedSampler", _evaluation_sampler),
    Rule(
        "eval-padded-loader",
        "evaluation through Fabric's/Accelerate's padded loaders, duplicates counted",
        _evaluation_prepared,
    ),
]
