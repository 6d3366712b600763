"""Printing, logging or saving on every process, with no rank-0 guard."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor import styles
from paratrain.tools.doctor.names import TORCH_SAVE, dotted
from paratrain.tools.doctor.project import imported, imported_class
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
from paratrain.tools.doctor.script import FUNCTIONS, Function, Script, keyword

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
    """``builtins.print = ...`` (the ``setup_for_distributed`` of torchvision's references,
    DINO, DeiT, seed 004), or ``sys.stdout`` replaced by rank (a writer that labels each
    line with the rank, ``/dev/null`` under ``if rank > 0:``), here or in a local module the
    script imports: print is already rank-aware."""
    return any(
        _replaces_print(module, node)
        for module in script.modules
        for node in module.nodes(ast.Assign)
    )


def _replaces_print(module: Script, node: ast.Assign) -> bool:
    for target in node.targets:
        if isinstance(target, ast.Attribute) and target.attr == "print":
            return True
        if dotted(target) == "sys.stdout" and (
            mentions_rank(node.value) or lexically_guarded(module, node)
        ):
            return True
    return False


def _kind(
    script: Script, call: ast.Call, loggers: set[str], logs: bool, prints: bool
) -> str | None:
    func = call.func
    if isinstance(func, ast.Name) and func.id == "print" and "print" not in script.imports:
        # `force=True` is a keyword only a replaced, rank-aware print takes: every rank, on purpose
        forced = any(k.arg == "force" for k in call.keywords)
        return "print" if prints and not forced else None
    full = script.full_name(func)
    if full == TORCH_SAVE:
        return "torch.save"
    if isinstance(func, ast.Attribute) and func.attr == "save_pretrained":
        # Transformers' save_pretrained(..., is_main_process=...) writes on one process
        return None if keyword(call, "is_main_process") is not None else "save_pretrained"
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
    sharded = any(module.uses(name) for module in script.modules for name in _SHARDED)
    savers = Savers(script)
    for node in script.nodes(ast.Call):
        kind = _kind(script, node, loggers, logs, prints)
        saver = savers.of(node) if kind is None else None
        if (kind is None and saver is None) or not every_rank.unguarded(node):
            continue
        if kind in ("print", "logging") and _names_its_rank(node):
            continue  # a line that names its rank is meant to come from every process
        if saver is not None:
            what = (
                f"{ast.unparse(node.func)}() writes with torch.save ({saver}) on every "
                "process: they all write the same file at once"
            )
        elif kind in ("torch.save", "save_pretrained"):
            what = f"{kind} runs on every process: they all write the same files at once"
        else:
            what = f"{kind} runs on every process: each line comes once per process"
        fix = f"do it on rank 0 only: {once}"
        if kind != "print" and kind != "logging" and sharded:
            fix = _SHARDED_SAVE  # under a rank-0 guard, the state_dict() collective would hang
        yield Hit(node, what, fix)


class Savers:
    """Calls of a local module's function or method that calls torch.save with no rank test
    of its own (``trainer.save(path)``, ``utils.save_checkpoint(state)``): where they are
    called on every process, every process writes."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self._classes: dict[str, tuple[Script, ast.ClassDef]] = {}
        self._saves: dict[int, str | None] = {}
        for name, values in script.assigned.items():
            for value, _ in values:
                full = script.full_name(value.func) if isinstance(value, ast.Call) else None
                if full is not None and (found := imported_class(script, full)) is not None:
                    self._classes[name] = found

    def of(self, call: ast.Call) -> str | None:
        """``file:line`` of the unguarded torch.save that ``call`` runs, if any."""
        func = call.func
        found: tuple[Script, Function] | None = None
        if isinstance(func, ast.Attribute) and (owner := dotted(func.value)) in self._classes:
            module, cls = self._classes[owner]
            methods = [f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
            found = next(((module, f) for f in methods if f.name == func.attr), None)
        elif (full := self.script.full_name(func)) is not None:
            found = imported(self.script, full)
        elif isinstance(func, ast.Name) and func.id not in self.script.functions():
            found = imported(self.script, func.id)  # a name lent by `from utils import *`
        if found is None:
            return None
        if id(found[1]) not in self._saves:  # once per function, however often it is called
            self._saves[id(found[1])] = self._save_in(*found)
        return self._saves[id(found[1])]

    @staticmethod
    def _save_in(module: Script, function: Function) -> str | None:
        for node in module.own_of(function, ast.Call):
            if (
                module.full_name(node.func) == TORCH_SAVE
                and not lexically_guarded(module, node)
                and not _in_memory(module, node)
            ):
                return f"{module.path}:{node.lineno}"
        return None


def _in_memory(script: Script, save: ast.Call) -> bool:
    """``torch.save(obj, buffer)`` into an ``io.BytesIO``: nothing is written to a file."""
    target = keyword(save, "f", 1)
    values = [target] if target is not None else []
    if (name := dotted(target) if target is not None else None) is not None:
        values += [v for v, _ in script.assigned_in(script.scope(save), name)]
    return any(isinstance(v, ast.Call) and script.full_name(v.func) == "io.BytesIO" for v in values)


#: modules whose models keep a shard per process: state_dict() is a collective
_SHARDED = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp", "deepspeed")
_SHARDED_SAVE = (
    "build the state on every process (FSDP's state_dict() gathers the shards: every "
    "process must call it), then write it on rank 0 only: `state = model.state_dict()`, "
    "`if dist.get_rank() == 0: torch.save(state, path)`; or torch.distributed.checkpoint."
    "save, which every process calls and which writes each shard once"
)


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
