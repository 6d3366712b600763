"""Printing, logging or saving on every process, with no rank-0 guard."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor import styles
from paratrain.tools.doctor.names import TORCH_SAVE, dotted
from paratrain.tools.doctor.ranks import (
    EveryRank,
    guard_of,
    launcher_calls,
    lexically_guarded,
    mentions_rank,
    multi_process,
)
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.rules.checkpoints import saves
from paratrain.tools.doctor.script import FUNCTIONS, Script

_LOG_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "log"}

#: how each kind of script writes once
_ONCE = {
    "accelerate": "accelerator.print(...) / `if accelerator.is_main_process:`",
    "fabric": "fabric.print(...) / fabric.save(...) / `if fabric.global_rank == 0:`",
    "horovod": "`if hvd.rank() == 0:`",
    "paratrain": "rt.print(...) / rt.save(...) / `if rt.is_main:`",
}
_DEFAULT_ONCE = "`if dist.get_rank() == 0:` (paratrain: rt.print(...), rt.save(...))"


def _loggers(script: Script) -> set[str]:
    """Names assigned from ``logging.getLogger(...)``."""
    return script.instances("logging.getLogger")


def _logging_per_rank(script: Script) -> bool:
    """Logging configured by rank (a level or a handler chosen by rank) is already once."""
    for node in script.nodes(ast.Call):
        if isinstance(node.func, ast.Attribute | ast.Name):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            configures = name in ("basicConfig", "setLevel", "disable", "addHandler")
            if configures and (mentions_rank(node) or lexically_guarded(script, node)):
                return True
    return False


def _print_replaced(script: Script) -> bool:
    """``builtins.print = ...`` (seed 004's setup_for_distributed): print is already rank-aware."""
    return any(
        any(isinstance(t, ast.Attribute) and t.attr == "print" for t in node.targets)
        for node in script.nodes(ast.Assign)
    )


def _kind(
    script: Script, call: ast.Call, loggers: set[str], logs: bool, prints: bool
) -> str | None:
    func = call.func
    if isinstance(func, ast.Name) and func.id == "print" and "print" not in script.imports:
        return "print" if prints else None
    full = script.full_name(func)
    if full == TORCH_SAVE:
        return "torch.save"
    if not logs or not isinstance(func, ast.Attribute) or func.attr not in _LOG_METHODS:
        return None
    if (full or "").startswith("logging.") or dotted(func.value) in loggers:
        return "logging"
    return None


def _names_its_rank(call: ast.Call) -> bool:
    """``print(f"rank {rank}: ...")``: the rank is among what is printed (not merely passed
    to a function whose result is printed)."""
    shown: list[ast.expr] = []
    for arg in call.args:
        if isinstance(arg, ast.JoinedStr):
            shown += [v.value for v in arg.values if isinstance(v, ast.FormattedValue)]
        elif isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute):
            if arg.func.attr == "format":  # "rank {}".format(rank)
                shown += arg.args
        else:
            shown.append(arg)
    return any(isinstance(e, ast.Name | ast.Attribute) and mentions_rank(e) for e in shown)


def _unguarded_output(script: Script) -> Iterator[Hit]:
    if not multi_process(script):
        return
    every_rank = EveryRank(script)
    loggers, logs, prints = (
        _loggers(script),
        not _logging_per_rank(script),
        not _print_replaced(script),
    )
    once = _ONCE.get(styles.detect(script).name, _DEFAULT_ONCE)
    for node in script.nodes(ast.Call):
        kind = _kind(script, node, loggers, logs, prints)
        if kind is None or not every_rank.unguarded(node):
            continue
        if kind != "torch.save" and _names_its_rank(node):
            continue  # a line that names its rank is meant to come from every process
        what = (
            "torch.save runs on every process: they all write the same file at once"
            if kind == "torch.save"
            else f"{kind} runs on every process: each line comes once per process"
        )
        yield Hit(node, what, f"do it on rank 0 only: {once}")


RULES = [Rule("unguarded-output", "printing, logging or saving on every rank", _unguarded_output)]


def _launcher_flags(script: Script) -> set[str]:
    """Flags that choose the launcher: ``if args.multiprocessing_distributed: mp.spawn(...)``.
    Under torchrun the script does not spawn, so such a flag is false on every process."""
    flags: set[str] = set()
    for call in launcher_calls(script):
        child: ast.AST = call
        for parent in script.ancestors(call):
            if isinstance(parent, ast.If) and any(child is s for s in parent.body):
                flags.update(d for n in ast.walk(parent.test) if (d := dotted(n)) is not None)
            if isinstance(parent, FUNCTIONS):
                break
            child = parent
    return flags


def _guard_holds_everywhere(script: Script) -> Iterator[Hit]:
    flags = _launcher_flags(script)
    if not flags:
        return
    for call, _ in saves(script):
        test = guard_of(script, call)
        if not isinstance(test, ast.BoolOp) or not isinstance(test.op, ast.Or):
            continue
        for operand in test.values:
            if (
                isinstance(operand, ast.UnaryOp)
                and isinstance(operand.op, ast.Not)
                and (flag := dotted(operand.operand)) in flags
            ):
                yield Hit(
                    call,
                    f"the guard ({ast.unparse(test)}) holds on every process when {flag} is "
                    f"false, as it is under torchrun ({flag} only chooses mp.spawn): every "
                    "process writes the same file at once",
                    "guard with the rank itself: `if dist.get_rank() == 0:` (paratrain: "
                    "rt.save writes once, however the processes were started)",
                )
                break


RULES.append(
    Rule(
        "rank-guard-flag",
        "a save guarded by a launcher flag that is false under torchrun: every rank writes",
        _guard_holds_everywhere,
    )
)
