"""A training script read with ``ast`` (never run), and the questions rules ask of it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.doctor.names import dotted, import_table, resolve
from paratrain.errors import UserError

Scope = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
LOOPS = (ast.For, ast.AsyncFor, ast.While)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass
class Script:
    path: str
    tree: ast.Module
    imports: dict[str, str]
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path) -> Script:
        """Parse ``path``, or raise ``UserError`` (not a .py file, unreadable, bad syntax)."""
        file = Path(path)
        if file.suffix != ".py":
            raise UserError(f"{file} is not a Python script (.py); doctor reads training scripts")
        try:
            source = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UserError(f"cannot read {file}: {reason}") from None
        return cls.parse(source, str(file))

    @classmethod
    def parse(cls, source: str, path: str = "<script>") -> Script:
        try:
            tree = ast.parse(source, filename=path)
        except SyntaxError as exc:
            raise UserError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
        script = cls(path, tree, import_table(tree))
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                script.parents[child] = node
        return script

    # -- names -------------------------------------------------------------------------------
    def full_name(self, node: ast.AST) -> str | None:
        return resolve(node, self.imports)

    def calls(self, *names: str) -> Iterator[ast.Call]:
        """Calls of the imported functions or classes ``names`` (full names)."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and self.full_name(node.func) in names:
                yield node

    def method_calls(self, attr: str) -> Iterator[ast.Call]:
        """Calls ``<anything>.attr(...)``."""
        for node in ast.walk(self.tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == attr
            ):
                yield node

    def uses(self, prefix: str) -> bool:
        """Whether the script imports anything from the module ``prefix``."""
        return any(f == prefix or f.startswith(prefix + ".") for f in self.imports.values())

    # -- where a node is ---------------------------------------------------------------------
    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parents:
            node = self.parents[node]
            yield node

    def scope(self, node: ast.AST) -> Scope:
        """The innermost function (or the module) whose code ``node`` belongs to."""
        for parent in self.ancestors(node):
            if isinstance(parent, (*FUNCTIONS, ast.Module)):
                return parent
        return self.tree

    def in_class(self, function: ast.AST) -> bool:
        return isinstance(self.parents.get(function), ast.ClassDef)

    def loops_around(self, node: ast.AST) -> list[ast.For | ast.AsyncFor | ast.While]:
        """The loops of ``node``'s own function that enclose it, innermost first (a loop's
        ``else`` and its iterable do not count: they run once)."""
        found: list[ast.For | ast.AsyncFor | ast.While] = []
        child = node
        for parent in self.ancestors(node):
            if isinstance(parent, FUNCTIONS):
                break
            if isinstance(parent, LOOPS) and any(child is s for s in parent.body):
                found.append(parent)
            child = parent
        return found

    def statement(self, node: ast.AST) -> ast.stmt:
        """The statement that holds ``node``."""
        current = node
        while not isinstance(current, ast.stmt):
            current = self.parents[current]
        return current

    def assignments(self, scope: Scope) -> Iterator[tuple[str, ast.expr, ast.Assign]]:
        """``(target, value, statement)`` for every ``target = value`` in ``scope``'s own
        code; tuple targets pair with tuple values element by element."""
        for node in own_nodes(scope):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for t, v in zip(target.elts, node.value.elts, strict=False):
                        if (name := dotted(t)) is not None:
                            yield name, v, node
                elif (name := dotted(target)) is not None:
                    yield name, node.value, node

    def functions(self) -> dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]:
        """Every function that is not a method, by name."""
        found: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not self.in_class(node):
                found.setdefault(node.name, []).append(node)
        return found


def own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``scope``'s own code, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (*FUNCTIONS, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def keyword(call: ast.Call, name: str, position: int | None = None) -> ast.expr | None:
    """The argument ``name`` of ``call``, by keyword or at ``position``."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if position is not None and len(call.args) > position:
        arg = call.args[position]
        return None if isinstance(arg, ast.Starred) else arg
    return None


def has_kwargs_splat(call: ast.Call) -> bool:
    """``f(**options)``: any keyword may be hidden in it."""
    return any(kw.arg is None for kw in call.keywords)


def identifiers(node: ast.AST) -> Iterator[str]:
    """Every name and attribute name in ``node``."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            yield sub.id
        elif isinstance(sub, ast.Attribute):
            yield sub.attr
