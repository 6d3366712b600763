"""What processes must do together: a collective under a rank-0 guard (the others never
join it: a hang), and a metric summed over one process's share, printed as if it were all."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor.collectives import Collectives, sharded_loaders
from paratrain.tools.doctor.names import dotted
from paratrain.tools.doctor.ranks import guard_of, mentions_rank, multi_process
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.script import Script, keyword, own_nodes

_RANK0_NAMES = ("main", "master", "zero", "primary", "leader", "chief")
#: what a helper's name says when it combines a value over the processes
_REDUCING_WORDS = ("reduce", "gather", "sync")


def _rank0_test(test: ast.expr) -> bool:
    """A test that holds on one process only: ``rank == 0``, ``rank != 0`` (before a
    return), ``is_main``, ``accelerator.is_main_process``, ``fabric.is_global_zero``...; an
    ``or`` may hold everywhere (``not distributed or rank == 0``), so it does not count."""
    if isinstance(test, ast.BoolOp):
        return isinstance(test.op, ast.And) and any(_rank0_test(v) for v in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _rank0_test(test.operand)
    if isinstance(test, ast.Compare):
        constants = [
            n.value
            for n in ast.walk(test)
            if isinstance(n, ast.Constant) and isinstance(n.value, int)
        ]
        return mentions_rank(test) and 0 in constants
    if isinstance(test, ast.Call):
        test = test.func
    last = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", "")
    return any(word in last.lower() for word in _RANK0_NAMES)


def _collective_under_guard(script: Script) -> Iterator[Hit]:
    if not multi_process(script):
        return
    collectives = Collectives.of(script)
    guarded: list[tuple[ast.Call, ast.expr]] = []
    #: (function, collective) -> the rank tests it is made under, and the branch
    branches: dict[tuple[int, str], set[tuple[str, bool]]] = {}
    for call in script.nodes(ast.Call):
        if not collectives.is_collective(call):
            continue
        test = guard_of(script, call)
        if test is None or not _rank0_test(test):
            continue
        guarded.append((call, test))
        key = (id(script.scope(call)), ast.unparse(call.func))
        branches.setdefault(key, set()).add((ast.unparse(test), _in_else(script, call, test)))
    for call, test in guarded:
        what = ast.unparse(call.func)
        if len(branches[(id(script.scope(call)), what)]) > 1:
            # `if rank == 0: gather(t, list) else: gather(t)`, or `if rank != 0: barrier()`
            # then `if rank == 0: barrier()`: every process makes it once
            continue
        yield Hit(
            call,
            f"{what} is a collective, called under a rank-0 guard ({ast.unparse(test)}): the "
            "other processes never make the same call, and the run hangs there",
            f"call {what} on every process, outside the guard (only the printing or writing "
            "that follows it belongs under the guard; paratrain's rt.save writes once by itself)",
        )


def _in_else(script: Script, call: ast.Call, test: ast.expr) -> bool:
    """Whether ``call`` is in the ``else`` of the ``if`` whose test is ``test``."""
    branch = script.parents.get(test)
    return isinstance(branch, ast.If) and script.in_block(call, branch.orelse) is not None


def _accumulators(loop: ast.For | ast.AsyncFor) -> set[str]:
    """Names summed in the loop: ``correct += ...``."""
    return {
        node.target.id
        for node in own_nodes(loop)
        if isinstance(node, ast.AugAssign)
        and isinstance(node.op, ast.Add)
        and isinstance(node.target, ast.Name)
    }


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _outputs(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id == "print"
    return isinstance(func, ast.Attribute) and func.attr in ("print", "info", "log")


def _metric_without_reduce(script: Script) -> Iterator[Hit]:
    if not multi_process(script):
        return
    sharded = sharded_loaders(script)
    if not sharded:
        return
    collectives = Collectives.of(script)
    helpers = _Helpers(script, sharded)
    received: list[tuple[ast.Call, set[str], str]] = []  # what helpers hand back, and where
    loops: list[ast.For | ast.AsyncFor] = [*script.nodes(ast.For), *script.nodes(ast.AsyncFor)]
    for loop in loops:
        summed = _summed(collectives, loop)
        if not summed:
            continue
        after = [n for n in script.own(script.scope(loop)) if getattr(n, "lineno", 0) > _end(loop)]
        # a loop over a sharded loader, or `def validate(model, loader)` summing over its
        # parameter, called with one: its uses, and what it returns to callers, are partial
        iterated = sharded & _dotted_names(loop.iter)
        calls = list(helpers.calls_sharding(loop))
        derived = _derive(after, summed)
        if not (iterated or calls) or any(_reduces(collectives, n, derived) for n in after):
            continue
        loader = sorted(iterated)[0] if iterated else calls[0][1]
        yield from _partial_uses(collectives, after, summed, loader)
        returns = [n.value for n in after if isinstance(n, ast.Return) and n.value is not None]
        returns = [value for value in returns if _names(value) & derived]
        for call, passed in calls:
            if names := _receivers(returns, derived, script.parents.get(call)):
                received.append((call, names, passed))
    yield from _caller_uses(script, collectives, received)


def _summed(collectives: Collectives, loop: ast.For | ast.AsyncFor) -> set[str]:
    """What an evaluation loop sums (not a training loop, nor one gathering each batch)."""
    trains = any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
        for n in own_nodes(loop)
    )
    gathers = any(  # each batch gathered in the loop: the sums are already global
        isinstance(n, ast.Call) and collectives.is_collective(n) for n in own_nodes(loop)
    )
    return set() if trains or gathers else _accumulators(loop)


def _derive(after: list[ast.AST], summed: set[str]) -> set[str]:
    derived = set(summed)
    for node in after:  # `accuracy = correct / total` carries the sum along
        if isinstance(node, ast.Assign) and _names(node.value) & derived:
            derived |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return derived


def _reduces(collectives: Collectives, node: ast.AST, derived: set[str]) -> bool:
    """A collective, or a helper doctor cannot read whose name says it reduces
    (``get_all_reduce_mean(loss)``, ``reduce_tensor``, ``all_gather_list``), given the sum."""
    if not isinstance(node, ast.Call) or not _names(node) & derived:
        return False
    name = (dotted(node.func) or "").rpartition(".")[2].lower()
    return collectives.is_collective(node) or any(w in name for w in _REDUCING_WORDS)


def _partial_uses(
    collectives: Collectives, after: list[ast.AST], summed: set[str], loader: str
) -> Iterator[Hit]:
    """The first use of a partial sum as a whole, unless it is reduced first."""
    derived = _derive(after, summed)
    if any(_reduces(collectives, n, derived) for n in after):
        return
    for node in after:
        use = _use(node, derived)
        if use is not None:
            yield _partial_hit(node, sorted(_names(node) & derived)[0], loader, use)
            return


def _partial_hit(node: ast.AST, shown: str, loader: str, use: str) -> Hit:
    return Hit(
        node,
        f"{shown} is summed over this process's share of {loader} "
        f"only (its sampler splits the data over the processes), then {use}",
        "sum it over the processes first (dist.all_reduce(tensor), "
        "hvd.allreduce, accelerator.gather_for_metrics; paratrain: "
        "rt.all_reduce(t, 'sum') with rt.setup_loader(loader, evaluation=True))",
    )


def _receivers(returns: list[ast.expr], derived: set[str], assign: ast.AST | None) -> set[str]:
    """The caller's names that receive a partial sum: ``val_loss = validate(...)``, or the
    matching element of ``val_loss, acc = validate(...)`` for ``return loss, acc``."""
    if not isinstance(assign, ast.Assign) or len(assign.targets) != 1:
        return set()
    target = assign.targets[0]
    found: set[str] = set()
    for value in returns:
        if isinstance(target, ast.Name):
            found.add(target.id)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            pairs = zip(target.elts, value.elts, strict=False)
            found |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _names(v) & derived}
    return found


def _caller_uses(
    script: Script, collectives: Collectives, received: list[tuple[ast.Call, set[str], str]]
) -> Iterator[Hit]:
    """The first use of each partial sum a helper returned, unless reduced: one pass over
    each calling scope however many calls it makes (linear in the file)."""
    by_scope: dict[int, list[tuple[ast.Call, set[str], str]]] = {}
    for item in received:
        by_scope.setdefault(id(script.scope(item[0])), []).append(item)
    for items in by_scope.values():
        items.sort(key=lambda item: _end(item[0]))
        origin: dict[str, int] = {}  # a name holding a partial sum -> which call's
        reduced: set[int] = set()
        first: dict[int, tuple[ast.AST, str, str]] = {}  # its first use, the name, how
        pending = 0
        for node in script.own(script.scope(items[0][0])):
            while pending < len(items) and _end(items[pending][0]) < getattr(node, "lineno", 0):
                origin.update(dict.fromkeys(items[pending][1], pending))
                pending += 1
            named = _names(node) & origin.keys() if origin else set()
            if not named:
                continue
            source = min(origin[n] for n in named)
            if isinstance(node, ast.Assign):
                origin.update({t.id: source for t in node.targets if isinstance(t, ast.Name)})
            if _reduces(collectives, node, set(named)):
                reduced |= {origin[n] for n in named}
            elif source not in first and (use := _use(node, set(named))) is not None:
                first[source] = (node, sorted(named)[0], use)
        for source, (node, shown, use) in sorted(first.items()):
            if source not in reduced:
                yield _partial_hit(node, shown, items[source][2], use)


class _Helpers:
    """Calls of the file's own functions with a sharded loader as an argument."""

    def __init__(self, script: Script, sharded: set[str]) -> None:
        self.script, self.sharded = script, sharded
        self._calls: dict[str, list[ast.Call]] | None = None

    def calls_sharding(self, loop: ast.For | ast.AsyncFor) -> Iterator[tuple[ast.Call, str]]:
        """``(call, loader)`` for each call handing a sharded loader to the parameter that
        ``loop`` (in a function, not a method) iterates."""
        function = self.script.scope(loop)
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            return
        if self.script.in_class(function):
            return
        params = [a.arg for a in function.args.args]
        iterated = [p for p in params if p in _dotted_names(loop.iter)]
        if not iterated:
            return
        position, name = params.index(iterated[0]), iterated[0]
        for call in self._by_name().get(function.name, []):
            arg = keyword(call, name, position)
            if arg is not None and (loader := dotted(arg)) in self.sharded:
                yield call, loader

    def _by_name(self) -> dict[str, list[ast.Call]]:
        if self._calls is None:  # once per script: every rule stays linear
            local = self.script.functions()
            self._calls = {}
            for call in self.script.nodes(ast.Call):
                if isinstance(call.func, ast.Name) and call.func.id in local:
                    self._calls.setdefault(call.func.id, []).append(call)
        return self._calls


def _use(node: ast.AST, derived: set[str]) -> str | None:
    """How a partial sum is used as a whole: shown, stepped into a scheduler (each process's
    learning rate then follows its own shard), or compared to choose the best model."""
    if isinstance(node, ast.Call) and _names(node) & derived:
        if _outputs(node):
            return "shown as if it were the whole: each process prints its own partial figure"
        if isinstance(node.func, ast.Attribute) and node.func.attr == "step":
            return (
                "given to a scheduler as if it were the whole: each process's learning rate "
                "follows its own shard"
            )
    if (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and _names(node.test) & derived
    ):
        return (
            "compared as if it were the whole, to choose the best model: each process "
            "chooses on its own shard"
        )
    return None


def _dotted_names(node: ast.AST) -> set[str]:
    return {d for n in ast.walk(node) if (d := dotted(n)) is not None}


def _end(node: ast.AST) -> int:
    end: int | None = getattr(node, "end_lineno", None)
    return end if end is not None else int(getattr(node, "lineno", 0))


RULES = [
    Rule(
        "collective-under-guard",
        "a collective (all_reduce, barrier, rt.save...) called on rank 0 only: a hang",
        _collective_under_guard,
    ),
    Rule(
        "metric-without-reduce",
        "a metric summed on each process's shard, printed without an all-reduce",
        _metric_without_reduce,
    ),
]
