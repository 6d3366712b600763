"""Which code runs on every process of a multi-process script, and which is rank-guarded.

A guard is an ``if`` whose test speaks of the rank or the main process (``rank == 0``,
``dist.get_rank() == 0``, ``is_main``, ``accelerator.is_main_process``,
``fabric.global_rank == 0``, ``hvd.rank() == 0``, ``rt.is_main``...), or an earlier
``if <such a test>: return``. The words are matched generously: a guard taken for one
never produces a finding, a guard missed would produce a false one.
"""

from __future__ import annotations

import ast
import re

from paratrain.doctor.names import SPAWN
from paratrain.doctor.script import FUNCTIONS, Script, identifiers

_RANK_WORDS = re.compile(r"rank|master|main|zero|primary|leader|chief", re.IGNORECASE)
_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise)


def mentions_rank(node: ast.AST) -> bool:
    return any(_RANK_WORDS.search(name) for name in identifiers(node))


def _exits(statements: list[ast.stmt]) -> bool:
    last = statements[-1] if statements else None
    if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
        return (ast.unparse(last.value.func)).endswith("exit")
    return isinstance(last, _EXITS)


def lexically_guarded(script: Script, node: ast.AST) -> bool:
    """Whether ``node`` sits under a rank test within its own function."""
    child = node
    for parent in script.ancestors(node):
        if (
            isinstance(parent, ast.If | ast.IfExp)
            and child is not parent.test
            and mentions_rank(parent.test)
        ):
            return True
        if isinstance(parent, ast.BoolOp) and mentions_rank(parent):
            return True  # `is_main and print(...)`
        body = getattr(parent, "body", None)
        if isinstance(body, list) and child in body:
            # an earlier `if rank != 0: return` in the same block
            for earlier in body[: body.index(child)]:
                if (
                    isinstance(earlier, ast.If)
                    and mentions_rank(earlier.test)
                    and (_exits(earlier.body) or _exits(earlier.orelse))
                ):
                    return True
        if isinstance(parent, FUNCTIONS):
            break
        child = parent
    return False


def spawn_targets(script: Script) -> set[str] | None:
    """The functions a launcher starts in every process (``mp.spawn(main, ...)``,
    ``rt.launch(train)``); None when the script spawns nothing (it is started once per
    process, by torchrun, accelerate launch, horovodrun...)."""
    calls = list(script.calls(*SPAWN))
    calls += [c for c in script.method_calls("launch") if _is_runtime(script, c.func)]
    if not calls:
        return None
    return {c.args[0].id for c in calls if c.args and isinstance(c.args[0], ast.Name)}


def _is_runtime(script: Script, func: ast.expr) -> bool:
    """``rt.launch``: ``rt`` was assigned from ``paratrain.Runtime(...)``."""
    if not isinstance(func, ast.Attribute) or not isinstance(func.value, ast.Name):
        return False
    owner = func.value.id
    for node in ast.walk(script.tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            named = any(isinstance(t, ast.Name) and t.id == owner for t in node.targets)
            if named and script.full_name(node.value.func) == "paratrain.Runtime":
                return True
    return False


class EveryRank:
    """Answers "does this node run, unguarded, on every process?"."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.functions = script.functions()
        targets = spawn_targets(script)
        # Under a launcher the script's own top level runs in the parent only.
        self.module_runs = targets is None
        self._running: set[str] = set(targets or ())
        self._expand()

    def _expand(self) -> None:
        """Functions reached by an unguarded call (or passed along) from code that runs on
        every rank also run on every rank."""
        changed = True
        while changed:
            changed = False
            for node in ast.walk(self.script.tree):
                if not isinstance(node, ast.Name) or node.id not in self.functions:
                    continue
                if node.id in self._running or isinstance(node.ctx, ast.Store):
                    continue
                if self._code_runs(node) and not lexically_guarded(self.script, node):
                    self._running.add(node.id)
                    changed = True

    def _code_runs(self, node: ast.AST) -> bool:
        scope = self.script.scope(node)
        if isinstance(scope, ast.Module):
            return self.module_runs
        if isinstance(scope, ast.Lambda) or self.script.in_class(scope):
            return False  # methods and lambdas: where they run is not known, so no finding
        return scope.name in self._running

    def unguarded(self, node: ast.AST) -> bool:
        return self._code_runs(node) and not lexically_guarded(self.script, node)
