"""What processes must do together: a collective under a rank-0 guard (the others never
join it: a hang), and a metric summed over one process's share, printed as if it were all."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor.collectives import Collectives, sharded_loaders
from paratrain.tools.doctor.names import dotted
from paratrain.tools.doctor.ranks import guard_of, mentions_rank, multi_process
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.script import Script, own_nodes

_RANK0_NAMES = ("main", "master", "zero", "primary", "leader", "chief")


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
    loops: list[ast.For | ast.AsyncFor] = [*script.nodes(ast.For), *script.nodes(ast.AsyncFor)]
    for loop in loops:
        iterated = sharded & _dotted_names(loop.iter)
        trains = any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "backward"
            for n in own_nodes(loop)
        )
        gathers = any(  # each batch gathered in the loop: the sums are already global
            isinstance(n, ast.Call) and collectives.is_collective(n) for n in own_nodes(loop)
        )
        summed = _accumulators(loop) if iterated and not trains and not gathers else set()
        if not summed:
            continue
        after = [n for n in script.own(script.scope(loop)) if getattr(n, "lineno", 0) > _end(loop)]
        derived = set(summed)
        for node in after:  # `accuracy = correct / total` carries the sum along
            if isinstance(node, ast.Assign) and _names(node.value) & derived:
                derived |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        reduced = any(
            isinstance(n, ast.Call) and collectives.is_collective(n) and _names(n) & derived
            for n in after
        )
        if reduced:
            continue
        for node in after:
            use = _use(node, derived)
            if use is not None:
                shown = sorted(_names(node) & derived)[0]
                yield Hit(
                    node,
                    f"{shown} is summed over this process's share of {sorted(iterated)[0]} "
                    f"only (its sampler splits the data over the processes), then {use}",
                    "sum it over the processes first (dist.all_reduce(tensor), "
                    "hvd.allreduce, accelerator.gather_for_metrics; paratrain: "
                    "rt.all_reduce(t, 'sum') with rt.setup_loader(loader, evaluation=True))",
                )
                break


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
