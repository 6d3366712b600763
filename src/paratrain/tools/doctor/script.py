"""A training script read with ``ast`` (never run), and the questions rules ask of it.

The tree is walked once, when the script is parsed: every node's parent and scope, and the
nodes of each type, go into tables. Rules read those tables instead of walking the tree
again, so that every rule is one pass over what it asks about (a 5 MB file is read in
seconds, not hours).
"""

from __future__ import annotations

import ast
import gc
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from paratrain.tools.doctor.names import dotted, import_table, resolve
from paratrain.utils.errors import UserError

Scope = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
Function = ast.FunctionDef | ast.AsyncFunctionDef
LOOPS = (ast.For, ast.AsyncFor, ast.While)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
#: shared singletons (``Load()``, ``Add()``...): no parent, no interest
_SKIPPED = (ast.expr_context, ast.operator, ast.boolop, ast.unaryop, ast.cmpop)
N = TypeVar("N", bound=ast.AST)


@dataclass
class Script:
    path: str
    tree: ast.Module
    imports: dict[str, str]
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    scopes: dict[ast.AST, Scope] = field(default_factory=dict)
    by_type: dict[type, list[ast.AST]] = field(default_factory=lambda: defaultdict(list))
    #: statement -> (the list of statements that holds it, its index there)
    blocks: dict[ast.AST, tuple[list[ast.stmt], int]] = field(default_factory=dict)
    _names: dict[ast.AST, str | None] = field(default_factory=dict)
    #: every node, in the order of the walk (pre-order: statements in source order)
    order: list[ast.AST] = field(default_factory=list)
    #: what rules compute once per script and share (rule family -> its results)
    memo: dict[str, Any] = field(default_factory=dict)
    #: the local modules it imports, read (``doctor.project``): full dotted name -> module
    local: dict[str, Script] = field(default_factory=dict)
    #: the local modules it star-imports (``from utils import *``)
    star: list[Script] = field(default_factory=list)
    #: itself, then every local module it reaches through imports
    modules: list[Script] = field(default_factory=list)

    @classmethod
    def read(cls, path: str | Path) -> Script:
        """Parse ``path``, or raise ``UserError`` (not a .py file, unreadable, bad syntax)."""
        file = Path(path)
        if file.suffix != ".py":
            raise UserError(f"{file} is not a Python script (.py); doctor reads training scripts")
        try:
            source = file.read_bytes()  # bytes: ast honours a `# -*- coding: ... -*-` line
        except OSError as exc:
            raise UserError(f"cannot read {file}: {exc.strerror or exc}") from None
        return cls.parse(source, str(file))

    @classmethod
    def parse(cls, source: str | bytes, path: str = "<script>") -> Script:
        enabled = gc.isenabled()
        gc.disable()  # an AST has no cycles; collecting while it is built triples the time
        try:
            try:
                tree = ast.parse(source, filename=path)
            except SyntaxError as exc:
                where = f"{path}:{exc.lineno}" if exc.lineno else path
                raise UserError(
                    f"{where}: syntax error: {exc.msg} (doctor reads Python 3 scripts)"
                ) from None
            except (ValueError, UnicodeDecodeError) as exc:  # null bytes, bad encoding
                raise UserError(f"{path}: cannot read it as Python 3: {exc}") from None
            except (RecursionError, MemoryError):
                raise UserError(
                    f"{path}: cannot read it: an expression is nested too deeply for Python's "
                    "parser (split it into several statements)"
                ) from None
            script = cls(path, tree, {})
            script._index()
            imports: list[ast.Import | ast.ImportFrom] = [
                *script.nodes(ast.Import),
                *script.nodes(ast.ImportFrom),
            ]
            script.imports = import_table(sorted(imports, key=_position))
            script.modules = [script]
        finally:
            if enabled:
                gc.enable()
        return script

    def _index(self) -> None:
        """One walk: parent, scope and type of every node."""
        by_type, parents, scopes = self.by_type, self.parents, self.scopes
        blocks, order = self.blocks, self.order
        stack: list[tuple[ast.AST, Scope]] = [(self.tree, self.tree)]
        found: list[tuple[ast.AST, Scope]] = []
        while stack:
            node, scope = stack.pop()
            by_type[type(node)].append(node)
            order.append(node)
            inner = node if isinstance(node, FUNCTIONS) else scope
            for name in node._fields:
                value = getattr(node, name, None)
                children = value if isinstance(value, list) else (value,)
                if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                    for index, statement in enumerate(value):
                        blocks[statement] = (value, index)
                for child in children:
                    if isinstance(child, ast.AST) and not isinstance(child, _SKIPPED):
                        parents[child] = node
                        scopes[child] = inner
                        found.append((child, inner))
            # pushed in reverse, popped in field order: statements come out in source order
            stack.extend(reversed(found))
            found.clear()

    # -- names -------------------------------------------------------------------------------
    def full_name(self, node: ast.AST) -> str | None:
        if node not in self._names:
            self._names[node] = resolve(node, self.imports)
        return self._names[node]

    def nodes(self, kind: type[N]) -> list[N]:
        """Every node of type ``kind``, in source order."""
        return self.by_type.get(kind, [])  # type: ignore[return-value]

    @cached_property
    def _calls_by_name(self) -> dict[str, list[ast.Call]]:
        found: dict[str, list[ast.Call]] = defaultdict(list)
        for call in self.nodes(ast.Call):
            if (name := self.full_name(call.func)) is not None:
                found[name].append(call)
        return found

    @cached_property
    def _calls_by_attr(self) -> dict[str, list[ast.Call]]:
        found: dict[str, list[ast.Call]] = defaultdict(list)
        for call in self.nodes(ast.Call):
            if isinstance(call.func, ast.Attribute):
                found[call.func.attr].append(call)
        return found

    def calls(self, *names: str) -> Iterator[ast.Call]:
        """Calls of the imported functions or classes ``names`` (full names)."""
        for name in dict.fromkeys(names):
            yield from self._calls_by_name.get(name, [])

    def method_calls(self, attr: str) -> Iterator[ast.Call]:
        """Calls ``<anything>.attr(...)``."""
        yield from self._calls_by_attr.get(attr, [])

    def uses(self, prefix: str) -> bool:
        """Whether the script imports anything from the module ``prefix``."""
        return any(f == prefix or f.startswith(prefix + ".") for f in self.imports.values())

    @cached_property
    def assigned(self) -> dict[str, list[tuple[ast.expr, ast.stmt]]]:
        """Name (``model``, ``self.model``) -> ``(value, statement)`` of each assignment to
        it, anywhere in the file; tuple targets pair with tuple values."""
        found: dict[str, list[tuple[ast.expr, ast.stmt]]] = defaultdict(list)
        for node in self.nodes(ast.Assign):
            for name, value in _pairs(node):
                found[name].append((value, node))
        for ann in self.nodes(ast.AnnAssign):
            if ann.value is not None and (target := dotted(ann.target)) is not None:
                found[target].append((ann.value, ann))
        return found

    @cached_property
    def _assigned_in(self) -> dict[tuple[int, str], list[tuple[ast.expr, ast.stmt]]]:
        found: dict[tuple[int, str], list[tuple[ast.expr, ast.stmt]]] = defaultdict(list)
        for name, pairs in self.assigned.items():
            for value, statement in pairs:
                found[(id(self.scope(statement)), name)].append((value, statement))
        for pairs in found.values():
            pairs.sort(key=lambda pair: _position(pair[1]))
        return found

    def assigned_in(self, scope: ast.AST, name: str) -> list[tuple[ast.expr, ast.stmt]]:
        """The assignments to ``name`` in ``scope``'s own code, in source order."""
        return self._assigned_in.get((id(scope), name), [])

    def instances(self, *classes: str) -> set[str]:
        """Names assigned from a call of one of ``classes`` (full names), in either branch
        of a conditional expression too (``Accelerator(...) if cpu else Accelerator()``)."""
        found: set[str] = set()
        for call in self.calls(*classes):
            parent = self.parents.get(call)
            while isinstance(parent, ast.IfExp):
                parent = self.parents.get(parent)
            if isinstance(parent, ast.Assign):
                found.update(name for t in parent.targets if (name := dotted(t)) is not None)
        return found

    # -- where a node is ---------------------------------------------------------------------
    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parents:
            node = self.parents[node]
            yield node

    def scope(self, node: ast.AST) -> Scope:
        """The innermost function (or the module) whose code ``node`` belongs to."""
        return self.scopes.get(node, self.tree)

    def in_class(self, function: ast.AST) -> bool:
        return isinstance(self.parents.get(function), ast.ClassDef)

    def owner_class(self, node: ast.AST) -> ast.ClassDef | None:
        """The class whose method ``node`` is in, if any."""
        scope = self.scope(node)
        parent = self.parents.get(scope)
        return parent if isinstance(parent, ast.ClassDef) else None

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

    def leads_to(self, earlier: ast.AST, later: ast.AST) -> bool:
        """``later`` comes after ``earlier`` in the block that holds ``earlier``'s statement
        or inside it: whenever that block goes on to ``later``, ``earlier`` has run (not a
        sibling branch of an ``if``)."""
        statement = self.statement(earlier)
        if statement not in self.blocks:
            return False
        block, index = self.blocks[statement]
        for node in (later, *self.ancestors(later)):
            if node in self.blocks and self.blocks[node][0] is block:
                return self.blocks[node][1] >= index
        return False

    def in_block(self, node: ast.AST, block: list[ast.stmt]) -> ast.stmt | None:
        """The statement of ``block`` that holds ``node`` (or is it), if any."""
        for candidate in (node, *self.ancestors(node)):
            if candidate in self.blocks and self.blocks[candidate][0] is block:
                return self.blocks[candidate][0][self.blocks[candidate][1]]
        return None

    @cached_property
    def _own(self) -> dict[ast.AST, list[ast.AST]]:
        found: dict[ast.AST, list[ast.AST]] = defaultdict(list)
        for node in self.order:  # the walk's order: statements in source order
            found[self.scopes.get(node, self.tree)].append(node)
        return found

    @cached_property
    def _own_by_type(self) -> dict[tuple[int, type], list[ast.AST]]:
        found: dict[tuple[int, type], list[ast.AST]] = defaultdict(list)
        for scope, nodes in self._own.items():
            for node in nodes:
                found[(id(scope), type(node))].append(node)
        return found

    def own_of(self, scope: ast.AST, kind: type[N]) -> list[N]:
        """The nodes of type ``kind`` in ``scope``'s own code, in source order."""
        return self._own_by_type.get((id(scope), kind), [])  # type: ignore[return-value]

    def own(self, scope: ast.AST) -> list[ast.AST]:
        """The nodes of ``scope``'s own code (a function or the module), in source order."""
        return self._own.get(scope, [])

    def assignments(self, scope: Scope) -> Iterator[tuple[str, ast.expr, ast.Assign]]:
        """``(target, value, statement)`` for every ``target = value`` in ``scope``'s own
        code; tuple targets pair with tuple values element by element."""
        for node in self.own(scope):
            if isinstance(node, ast.Assign):
                for name, value in _pairs(node):
                    yield name, value, node

    @cached_property
    def _functions(self) -> dict[str, list[Function]]:
        found: dict[str, list[Function]] = defaultdict(list)
        for node in self.all_functions:
            if not self.in_class(node):
                found[node.name].append(node)
        return found

    def functions(self) -> dict[str, list[Function]]:
        """Every function that is not a method, by name."""
        return self._functions

    @cached_property
    def all_functions(self) -> list[Function]:
        """Every function and method, in source order."""
        functions: list[Function] = [
            *self.nodes(ast.FunctionDef),
            *self.nodes(ast.AsyncFunctionDef),
        ]
        return sorted(functions, key=_position)


def _position(node: ast.AST) -> tuple[int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


def _pairs(node: ast.Assign) -> Iterator[tuple[str, ast.expr]]:
    for target in node.targets:
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
            for t, v in zip(target.elts, node.value.elts, strict=False):
                if (name := dotted(t)) is not None:
                    yield name, v
        elif isinstance(target, ast.Tuple):  # `model, opt = accelerator.prepare(...)`
            for t in target.elts:
                if (name := dotted(t)) is not None:
                    yield name, node.value
        elif (name := dotted(target)) is not None:
            yield name, node.value


def own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``scope``'s own code, not descending into nested functions or classes
    (for a subtree such as a loop; for a function or the module, ``Script.own`` is indexed)."""
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
