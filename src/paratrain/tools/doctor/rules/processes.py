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
    for call in script.nodes(ast.Call):
        if not collectives.is_collective(call):
            continue
        test = guard_of(script, call)
        if test is None or not _rank0_test(test):
            continue
        what = ast.unparse(call.func)
        yield Hit(
            call,
            f"{what} is a collective, called under a rank-0 guard ({ast.unparse(test)}): the "
            "other processes never make the same call, and the run hangs there",
            f"call {what} on every process, outside the guard (only the printing or writing "
            "that follows it belongs under the guard; paratrain's rt.save writes once by itself)",
        )


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
            if isinstance(node, ast.Call) and _outputs(node) and _names(node) & derived:
                shown = sorted(_names(node) & derived)[0]
                yield Hit(
                    node,
                    f"{shown} is summed over this process's share of {sorted(iterated)[0]} "
                    "only (its sampler splits the data over the processes), then shown as "
                    "if it were the whole: each process prints its own partial figure",
                    "sum it over the processes first (dist.all_reduce(tensor), "
                    "hvd.allreduce, accelerator.gather_for_metrics; paratrain: "
                    "rt.all_reduce(t, 'sum') with rt.setup_loader(loader, evaluation=True))",
                )
                break


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
