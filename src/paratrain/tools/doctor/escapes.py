"""Where an object goes that doctor cannot follow: a rule that cannot see what happens to it
is not sure.

A loader handed to a function of the file, or of a local module doctor read, is still in
sight; handed to a function doctor could not read (a module it did not find), it escapes.
Builtins and the libraries whose behaviour rules already know (``torch``, ``tqdm``...) only
iterate what they are given.
"""

from __future__ import annotations

import ast
import builtins
import re

from paratrain.tools.doctor.names import dotted
from paratrain.tools.doctor.project import imported_function
from paratrain.tools.doctor.script import Function, Script

#: libraries that iterate or measure a loader without changing what a metric counts
_KNOWN = ("torch", "tqdm", "numpy", "itertools", "functools", "math", "time", "logging")
_EVALUATOR = re.compile(r"evaluator", re.IGNORECASE)


def _passed(script: Script) -> dict[str, list[ast.Call]]:
    """Name -> the calls it is passed to (as an argument, by position or keyword)."""
    if "passed" not in script.memo:
        found: dict[str, list[ast.Call]] = {}
        for call in script.nodes(ast.Call):
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                if (name := dotted(arg)) is not None:
                    found.setdefault(name, []).append(call)
        script.memo["passed"] = found
    passed: dict[str, list[ast.Call]] = script.memo["passed"]
    return passed


def callee(script: Script, call: ast.Call) -> Function | None:
    """The function of the file or of a local module read that ``call`` runs, if known."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in script.functions():
        return script.functions()[func.id][0]
    full = script.full_name(func)
    if full is not None:
        return imported_function(script, full)
    if isinstance(func, ast.Name):  # a star-imported name
        return imported_function(script, func.id)
    return None


def _known(script: Script, call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Name) and func.id in vars(builtins) and func.id not in script.imports:
        return True
    full = script.full_name(func) or ""
    return full.split(".")[0] in _KNOWN


def escapes(script: Script, names: set[str]) -> bool:
    """Whether any of ``names`` is handed to code doctor could not read."""
    return any(_escapes(script, name) for name in names)


def _escapes(script: Script, name: str) -> bool:
    key = f"escapes:{name}"
    if key not in script.memo:  # once per name, however many samplers share it
        script.memo[key] = any(
            not _known(script, call) and callee(script, call) is None
            for call in _passed(script).get(name, [])
        )
    found: bool = script.memo[key]
    return found


def evaluated_by_an_evaluator(script: Script, names: set[str]) -> bool:
    """Whether any of ``names`` goes to a function that builds an evaluator object
    (``CocoEvaluator``...), which may merge the processes' results by sample id and drop
    the duplicates itself."""
    return any(_evaluated(script, name) for name in names)


def _evaluated(script: Script, name: str) -> bool:
    key = f"evaluated:{name}"
    if key not in script.memo:  # once per name
        functions = [callee(script, call) for call in _passed(script).get(name, [])]
        script.memo[key] = any(f is not None and _builds_an_evaluator(script, f) for f in functions)
    found: bool = script.memo[key]
    return found


def _builds_an_evaluator(script: Script, function: Function) -> bool:
    key = f"evaluator:{id(function)}"
    if key not in script.memo:  # once per function, however many loaders it is given
        script.memo[key] = any(
            isinstance(node, ast.Name | ast.Attribute)
            and _EVALUATOR.search(node.id if isinstance(node, ast.Name) else node.attr)
            for node in ast.walk(function)
        )
    found: bool = script.memo[key]
    return found


def acknowledged(script: Script, node: ast.AST, word: str) -> bool:
    """The code around ``node`` (its function) says ``word`` in a string: the authors know
    (a warning that "duplicate entries are added")."""
    scope = script.scope(node)
    key = f"acknowledged:{id(scope)}:{word}"
    if key not in script.memo:  # once per function and word
        script.memo[key] = any(
            isinstance(n.value, str) and word in n.value.lower()
            for n in script.own_of(scope, ast.Constant)
        )
    found: bool = script.memo[key]
    return found
