"""Starting processes: mp.spawn outside the ``__main__`` guard, and a fixed port."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from paratrain.tools.doctor.names import INIT_PROCESS_GROUP, dotted
from paratrain.tools.doctor.ranks import launcher_calls
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.script import Script, keyword

_LOCAL_TCP = re.compile(r"^tcp://(127\.0\.0\.1|localhost|0\.0\.0\.0):(\d*)")


def _under_main_guard(script: Script, node: ast.AST) -> bool:
    for parent in script.ancestors(node):
        if isinstance(parent, ast.If) and isinstance(parent.test, ast.Compare):
            sides = [parent.test.left, *parent.test.comparators]
            names = {n.id for n in sides if isinstance(n, ast.Name)}
            values = {n.value for n in sides if isinstance(n, ast.Constant)}
            if "__name__" in names and "__main__" in values:
                return True
    return False


def _spawn_without_guard(script: Script) -> Iterator[Hit]:
    fix = 'put the call under `if __name__ == "__main__":`'
    callers: dict[str, list[ast.Call]] = {}
    for node in script.nodes(ast.Call):
        if isinstance(node.func, ast.Name):
            callers.setdefault(node.func.id, []).append(node)
    for call in launcher_calls(script):
        what = ast.unparse(call.func)
        scope = script.scope(call)
        if isinstance(scope, ast.Module):
            if not _under_main_guard(script, call):
                yield Hit(
                    call,
                    f"{what} runs at import time: every started process imports this "
                    "file again and starts processes of its own",
                    fix,
                )
            continue
        if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef) or script.in_class(scope):
            continue
        for node in callers.get(scope.name, []):
            if isinstance(script.scope(node), ast.Module) and not _under_main_guard(script, node):
                yield Hit(
                    node,
                    f"{scope.name}() calls {what} (line {call.lineno}) at import time: every "
                    "started process imports this file again and starts processes of its own",
                    fix,
                )


def _fixed_port(script: Script) -> Iterator[Hit]:
    fix = (
        "let a launcher choose: torchrun --standalone, init_method='env://', or a free port "
        "(paratrain's launcher picks one by itself)"
    )
    for call in script.calls(INIT_PROCESS_GROUP):
        method = keyword(call, "init_method", 1)
        if method is None:
            continue
        port = _local_port(script, method)
        if port is not None:
            yield Hit(
                method,
                f"init_method binds a fixed local port ({port}): two runs on this machine "
                "collide (EADDRINUSE), or one joins the other's process group",
                fix,
            )
    for call in script.method_calls("setdefault"):
        # os.environ.setdefault("MASTER_PORT", "29500"): fixed unless the caller sets it
        if (
            script.full_name(call.func) == "os.environ.setdefault"
            and len(call.args) == 2
            and isinstance(call.args[0], ast.Constant)
            and call.args[0].value == "MASTER_PORT"
            and (port := _literal(call.args[1])) is not None
        ):
            yield Hit(
                call,
                f"MASTER_PORT defaults to a fixed port ({port}): two runs on this machine "
                "collide unless each caller sets it",
                fix,
            )
    for node in script.nodes(ast.Assign):
        # os.environ["MASTER_PORT"] = "12355"
        if len(node.targets) == 1:
            target = node.targets[0]
            if (
                isinstance(target, ast.Subscript)
                and script.full_name(target.value) == "os.environ"
                and isinstance(target.slice, ast.Constant)
                and target.slice.value == "MASTER_PORT"
                and (port := _literal(node.value)) is not None
            ):
                yield Hit(
                    node,
                    f"MASTER_PORT is fixed ({port}): two runs on this machine collide",
                    fix,
                )


def _literal(node: ast.expr) -> str | None:
    """A port written in the script: ``2033``, ``"2033"``, ``str(2033)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1:
        return _literal(node.args[0]) if node.func.id in ("str", "int") else None
    if isinstance(node, ast.Constant) and str(node.value).isdigit():
        return str(node.value)
    return None


def _local_port(script: Script, method: ast.expr) -> str | None:
    """The fixed port of a ``tcp://127.0.0.1:PORT`` address, or None."""
    prefix, port_expr = None, None
    if isinstance(method, ast.Constant) and isinstance(method.value, str):
        match = _LOCAL_TCP.match(method.value)
        return match.group(2) or None if match else None
    if isinstance(method, ast.BinOp) and isinstance(method.op, ast.Add):
        if isinstance(method.left, ast.Constant) and isinstance(method.left.value, str):
            prefix, port_expr = method.left.value, method.right
    elif isinstance(method, ast.JoinedStr) and len(method.values) == 2:
        first, second = method.values
        if isinstance(first, ast.Constant) and isinstance(second, ast.FormattedValue):
            prefix, port_expr = str(first.value), second.value
    if prefix is None or port_expr is None or not _LOCAL_TCP.match(prefix):
        return None
    return _fixed_value(script, port_expr)


def _fixed_value(script: Script, node: ast.expr) -> str | None:
    """The port, when it is a literal, a name only ever assigned a literal, or an argparse
    option with a literal default (every run gets it unless told otherwise)."""
    if (literal := _literal(node)) is not None:
        return literal
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str":
        return _fixed_value(script, node.args[0]) if len(node.args) == 1 else None
    if isinstance(node, ast.Name):
        values = [v for v, _ in script.assigned.get(node.id, [])]
        literals = [_literal(v) for v in values]
        return literals[0] if literals and all(literals) else None
    if isinstance(node, ast.Attribute):
        return _argparse_default(script, node.attr)
    return None


def _argparse_default(script: Script, dest: str) -> str | None:
    for call in script.method_calls("add_argument"):
        flags = [a.value for a in call.args if isinstance(a, ast.Constant)]
        given_dest = keyword(call, "dest")
        names = {str(f).lstrip("-").replace("-", "_") for f in flags}
        if isinstance(given_dest, ast.Constant):
            names = {str(given_dest.value)}
        default = keyword(call, "default")
        if dest in names and default is not None:
            return _literal(default)
    return None


def _local_rank_as_rank(script: Script) -> Iterator[Hit]:
    for call in script.calls(INIT_PROCESS_GROUP):
        rank = keyword(call, "rank", 3)
        if rank is None or not _is_local_rank(script, rank, call):
            continue
        yield Hit(
            rank,
            f"init_process_group(rank={ast.unparse(rank)}) passes the local rank (the "
            "process's index on its machine) where the global rank belongs: on two machines, "
            "two processes claim every rank and the group never forms, or mixes up",
            "pass the global rank: int(os.environ['RANK']) under torchrun, or node_rank * "
            "processes_per_node + local_rank (paratrain's launcher sets both)",
        )


def _is_local_rank(script: Script, node: ast.expr, at: ast.AST, depth: int = 0) -> bool:
    """``args.local_rank``, ``int(os.environ["LOCAL_RANK"])``, or a name assigned from one;
    not a function's parameter (``mp.spawn`` on one machine: its index is the rank)."""
    scope = script.scope(at)
    if (
        isinstance(node, ast.Name)
        and isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.id in {a.arg for a in scope.args.args}
        and not script.assigned.get(node.id)
    ):
        return False
    text = ast.unparse(node)
    if "local_rank" in text.lower() or "LOCAL_RANK" in text:
        return True
    name = dotted(node)
    if name is None or depth > 2:
        return False
    earlier = [
        v
        for v, s in script.assigned.get(name, [])
        if script.scope(s) is scope and s.lineno < getattr(at, "lineno", 0)
    ]
    return bool(earlier) and _is_local_rank(script, earlier[-1], at, depth + 1)


RULES = [
    Rule(
        "spawn-without-main-guard",
        'mp.spawn outside `if __name__ == "__main__":`',
        _spawn_without_guard,
    ),
    Rule("fixed-port", "a hard-coded tcp://127.0.0.1:PORT or MASTER_PORT", _fixed_port),
    Rule(
        "local-rank-as-rank",
        "init_process_group(rank=local_rank): the local rank passed as the global rank",
        _local_rank_as_rank,
    ),
]
