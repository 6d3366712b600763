"""Rules of the house that a reader of the code relies on, checked on the source with ast.

- The environment is read in one place (``utils.environment``), and by the threads' setup
  that must run before torch is imported (``launching.threads``, ``launching.wait_policy``):
  at most four modules of ``src/`` touch ``os.environ`` or ``os.getenv``.
- ``RANK`` is parsed in one place.
- No strategy name is compared outside ``strategies/`` (and ``plan``'s formula per layout):
  the runtime, the loop and the launchers ask the strategy.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "paratrain"
STRATEGY_NAMES = {"cpu", "cuda", "mps", "dp", "dp-balanced", "ddp", "fsdp", "pipeline"}


def _modules() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(SRC)): ast.parse(path.read_text(), str(path))
        for path in sorted(SRC.rglob("*.py"))
    }


def _touches_environment(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "putenv", "unsetenv")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(alias.name in ("environ", "getenv") for alias in node.names)
        ):
            return True
    return False


def test_the_environment_is_read_in_at_most_four_modules() -> None:
    readers = sorted(name for name, tree in _modules().items() if _touches_environment(tree))
    assert len(readers) <= 4, readers
    assert "utils/environment.py" in readers


def _reads_rank(node: ast.AST) -> bool:
    """``get("RANK")``, ``env_int("RANK")`` or ``environ["RANK"]`` read: not a key written
    into a child's environment."""
    if isinstance(node, ast.Call):
        return any(isinstance(a, ast.Constant) and a.value == "RANK" for a in node.args)
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "RANK"
    return False


def test_rank_is_parsed_in_one_place() -> None:
    parsing = [
        name for name, tree in _modules().items() for node in ast.walk(tree) if _reads_rank(node)
    ]
    assert sorted(set(parsing)) == ["utils/environment.py"], parsing


def test_no_strategy_name_is_compared_outside_strategies() -> None:
    found = []
    for name, tree in _modules().items():
        # the strategies themselves, the catalog that names them without torch, and plan's
        # memory formulas, one per layout it predicts
        if name.startswith(("strategies/", "utils/catalog", "tools/plan/layouts")):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            named = any(
                isinstance(o, ast.Attribute) and o.attr in ("name", "strategy") for o in operands
            )
            literal = any(
                isinstance(o, ast.Constant) and o.value in STRATEGY_NAMES for o in operands
            )
            if named and literal:
                found.append(f"{name}:{node.lineno}")
    assert found == []
