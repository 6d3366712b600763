"""Which code runs on every process of a multi-process script, and which is rank-guarded.

A guard is an ``if`` whose test speaks of the rank or the main process (``rank == 0``,
``dist.get_rank() == 0``, ``is_main``, ``accelerator.is_main_process``,
``fabric.global_rank == 0``, ``hvd.rank() == 0``, ``rt.is_main``...), or an earlier
``if <such a test>: return``. The words are matched generously: a guard taken for one
never produces a finding, a guard missed would produce a false one.

Code reached from code that runs on every process runs there too: functions called (or
passed along), methods called on ``self`` or on an instance of a class of the file, a class's
``__init__`` when it is built. The block that calls a launcher (``mp.spawn(main)``,
``horovod.run(main)``, ``rt.launch(main)``) runs in the launching process alone.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict

from paratrain.tools.doctor.names import (
    ACCELERATOR,
    DDP,
    FABRIC,
    INIT_PROCESS_GROUP,
    RUNTIME,
    SPAWN,
    dotted,
)
from paratrain.tools.doctor.script import FUNCTIONS, Function, Script, identifiers

_RANK_WORDS = re.compile(r"rank|master|main|zero|primary|leader|chief|gpu", re.IGNORECASE)
_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise)
#: launchers that start a function in new processes, besides mp.spawn and rt.launch
_RUNNERS = ("horovod.run", "horovod.torch.run")
_PROCESSES = ("multiprocessing.Process", "torch.multiprocessing.Process")
#: calls that make a script one of several processes, besides DDP and the launchers
STARTERS = (
    INIT_PROCESS_GROUP,
    "torch.distributed.device_mesh.init_device_mesh",
    "torch.distributed.fsdp.FullyShardedDataParallel",
    "torch.distributed.fsdp.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard",
    "deepspeed.initialize",
    "deepspeed.init_distributed",
    "timm.utils.init_distributed_device",
    "timm.utils.distributed.init_distributed_device",
)


#: environment variables that hold a rank (``int(os.environ.get("RANK", 0)) == 0``)
_RANK_VARIABLES = {"RANK", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}


def mentions_rank(node: ast.AST) -> bool:
    if any(_RANK_WORDS.search(name) for name in identifiers(node)):
        return True
    return any(
        _names_a_rank(n, n.slice if isinstance(n, ast.Subscript) else None)
        for n in ast.walk(node)
        if isinstance(n, ast.Constant | ast.Subscript)
    )


def _names_a_rank(node: ast.AST, key: ast.AST | None) -> bool:
    """An environment variable that holds a rank (``"RANK"``), or a rank kept in a mapping:
    ``opt["rank"]``, ``cfg["local_rank"]`` (KAIR's options)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in _RANK_VARIABLES
    return (
        isinstance(key, ast.Constant)
        and isinstance(key.value, str)
        and _RANK_WORDS.search(key.value) is not None
    )


def _exits(statements: list[ast.stmt]) -> bool:
    last = statements[-1] if statements else None
    if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
        name = dotted(last.value.func) or ""
        return name.endswith("exit")
    return isinstance(last, _EXITS)


def guard_of(script: Script, node: ast.AST) -> ast.expr | None:
    """The rank test ``node`` sits under within its own function, or None."""
    child = node
    for parent in script.ancestors(node):
        if (
            isinstance(parent, ast.If | ast.IfExp)
            and child is not parent.test
            and mentions_rank(parent.test)
        ):
            return parent.test
        if isinstance(parent, ast.BoolOp) and mentions_rank(parent):
            return parent  # `is_main and print(...)`
        if child in script.blocks:
            # an earlier `if rank != 0: return` in the same block
            block, index = script.blocks[child]
            exit_at = _first_rank_exit(script, block)
            if exit_at is not None and exit_at < index:
                exit_if = block[exit_at]
                assert isinstance(exit_if, ast.If)
                return exit_if.test
        if isinstance(parent, FUNCTIONS):
            break
        child = parent
    return None


def _first_rank_exit(script: Script, block: list[ast.stmt]) -> int | None:
    """Index of the first ``if <rank test>: return`` of ``block`` (computed once per block)."""
    key = f"rank_exit:{id(block)}"
    if key not in script.memo:
        script.memo[key] = next(
            (
                i
                for i, s in enumerate(block)
                if isinstance(s, ast.If)
                and mentions_rank(s.test)
                and (_exits(s.body) or _exits(s.orelse))
            ),
            None,
        )
    found: int | None = script.memo[key]
    return found


def lexically_guarded(script: Script, node: ast.AST) -> bool:
    """Whether ``node`` sits under a rank test within its own function."""
    return guard_of(script, node) is not None


def launcher_calls(script: Script) -> list[ast.Call]:
    """``mp.spawn(fn)``, ``horovod.run(fn)``, ``rt.launch(fn)`` of a paratrain Runtime,
    ``multiprocessing.Process(target=fn)``."""
    runtimes = script.instances(RUNTIME)
    calls = [*script.calls(*SPAWN), *script.calls(*_RUNNERS)]
    calls += [c for c in script.calls(*_PROCESSES) if _target(c) is not None]
    for call in script.method_calls("launch"):
        if not isinstance(call.func, ast.Attribute):
            continue
        owner = call.func.value  # rt.launch(main), or paratrain.Runtime(...).launch(main)
        built = isinstance(owner, ast.Call) and script.full_name(owner.func) == RUNTIME
        if dotted(owner) in runtimes or built:
            calls.append(call)
    return calls


def spawn_targets(script: Script) -> set[str] | None:
    """The functions a launcher starts in every process (``mp.spawn(main, ...)``,
    ``rt.launch(train)``); None when the script spawns nothing (it is started once per
    process, by torchrun, accelerate launch, horovodrun...)."""
    calls = launcher_calls(script)
    if not calls:
        return None
    targets = {c.args[0].id for c in calls if c.args and isinstance(c.args[0], ast.Name)}
    started = {t for c in calls if (t := _target(c)) is not None}
    # Processes started with different functions play roles (a parameter server and its
    # trainers): none of them is "every process"
    return targets | (started if len(started) == 1 else set())


def _target(call: ast.Call) -> str | None:
    """``Process(target=train)``: the function the new process runs."""
    target = next((k.value for k in call.keywords if k.arg == "target"), None)
    return target.id if isinstance(target, ast.Name) else None


def multi_process(script: Script) -> bool:
    """The script runs as several processes: it launches them, or is one of them, or a
    local module it imports starts a process group (``utils.init_distributed_mode(args)``,
    ``from utils import setup``)."""
    if "multi_process" not in script.memo:
        script.memo["multi_process"] = (
            spawn_targets(script) is not None
            or script.uses("horovod")
            or script.uses("deepspeed")
            or starts_group(script)
        )
    found: bool = script.memo["multi_process"]
    return found


def starts_group(script: Script) -> bool:
    """The script, or a local module it imports, starts a process group or wraps a model
    for several processes (DDP, FSDP, Accelerate, Fabric, DeepSpeed...)."""
    started = (*STARTERS, DDP, *SPAWN, ACCELERATOR, FABRIC)
    return any(any(True for _ in module.calls(*started)) for module in script.modules)


#: Accelerate's registrations of functions that save_state / load_state call
_STATE_HOOKS = ("register_save_state_pre_hook", "register_load_state_pre_hook")


class EveryRank:
    """Answers "does this node run, unguarded, on every process?"."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.functions = script.functions()
        self._launcher_blocks = self._blocks_of(launcher_calls(script))
        targets = spawn_targets(script)
        # Under a launcher the script's own top level runs in the parent only.
        self.module_runs = targets is None
        self._running: set[ast.AST] = {script.tree} if self.module_runs else set()
        self._running.update(f for name in targets or () for f in self.functions.get(name, []))
        self._expand()

    def _blocks_of(self, calls: list[ast.Call]) -> set[int]:
        """The statement lists that hold a launcher call: they run in the parent."""
        blocks: set[int] = set()
        for call in calls:
            statement = self.script.statement(call)
            if statement in self.script.blocks:
                blocks.add(id(self.script.blocks[statement][0]))
        return blocks

    def in_launcher(self, node: ast.AST) -> bool:
        if not self._launcher_blocks:
            return False
        blocks = self.script.blocks
        for candidate in (node, *self.script.ancestors(node)):
            if isinstance(candidate, (*FUNCTIONS, ast.ClassDef)):
                break  # a function defined in the launcher's block runs where it is called
            if candidate in blocks and id(blocks[candidate][0]) in self._launcher_blocks:
                return True
        return False

    def _calls(self) -> dict[ast.AST, list[tuple[ast.AST, list[Function]]]]:
        """Scope -> the references in its code to functions and methods of the file."""
        script = self.script
        classes = {c.name: c for c in script.nodes(ast.ClassDef)}
        methods = {
            name: {
                f.name: f for f in c.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            }
            for name, c in classes.items()
        }
        # `trainer = Trainer(...)`: which class each name holds
        holds = {
            target: value.func.id
            for target, values in script.assigned.items()
            for value, _ in values
            if isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id in classes
        }
        refs: dict[ast.AST, list[tuple[ast.AST, list[Function]]]] = defaultdict(list)
        for name in script.nodes(ast.Name):
            if name.id in self.functions and isinstance(name.ctx, ast.Load):
                refs[script.scope(name)].append((name, self.functions[name.id]))
            if name.id in classes and isinstance(name.ctx, ast.Load):
                init = methods[name.id].get("__init__")
                if init is not None:
                    refs[script.scope(name)].append((name, [init]))
        for attr in script.nodes(ast.Attribute):
            owner = dotted(attr.value)
            cls: str | None = None
            if owner == "self" and (c := script.owner_class(attr)) is not None:
                cls = c.name
            elif owner is not None:
                cls = holds.get(owner)
            if cls is not None and attr.attr in methods.get(cls, {}):
                refs[script.scope(attr)].append((attr, [methods[cls][attr.attr]]))
        return refs

    def _expand(self) -> None:
        """Functions reached by an unguarded call (or passed along) from code that runs on
        every rank also run on every rank: one pass over the references, breadth first."""
        refs = self._calls()
        queue = list(self._running)
        while queue:
            scope = queue.pop()
            for node, defs in refs.get(scope, []):
                if all(d in self._running for d in defs):
                    continue
                if lexically_guarded(self.script, node) or self.in_launcher(node):
                    continue
                if self._save_state_hook(node):
                    continue
                for d in defs:
                    if d not in self._running:
                        self._running.add(d)
                        queue.append(d)

    def _save_state_hook(self, node: ast.AST) -> bool:
        """``accelerator.register_save_state_pre_hook(save_model_hook)``: the hook runs where
        ``save_state`` runs (on the main process, in most scripts), not where it is handed."""
        call = self.script.parents.get(node)
        func = call.func if isinstance(call, ast.Call) else None
        return isinstance(func, ast.Attribute) and func.attr in _STATE_HOOKS

    def runs(self, node: ast.AST) -> bool:
        """Whether the code of ``node``'s function runs on every process (guards aside)."""
        return self.script.scope(node) in self._running

    def unguarded(self, node: ast.AST) -> bool:
        return (
            self.runs(node)
            and not lexically_guarded(self.script, node)
            and not self.in_launcher(node)
        )


def is_entry(script: Script) -> bool:
    """A script that is run, not a module that is imported: a ``__main__`` guard, or code
    at its top level that does something (a loop, a launcher, a process group)."""
    for test in script.nodes(ast.Compare):
        sides = [test.left, *test.comparators]
        if any(isinstance(n, ast.Name) and n.id == "__name__" for n in sides) and any(
            isinstance(n, ast.Constant) and n.value == "__main__" for n in sides
        ):
            return True
    # a script without a guard: a loop or a call at its top level (a launcher, a process
    # group...); a module of helpers only defines them
    return any(
        isinstance(s, (*_TOP_LOOPS, ast.Expr)) and not _docstring(s) for s in script.tree.body
    )


_TOP_LOOPS = (ast.For, ast.AsyncFor, ast.While, ast.With)


def _docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
