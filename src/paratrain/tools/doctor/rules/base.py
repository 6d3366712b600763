"""What a rule is: an id, a one-line summary, and a check that finds its mistakes."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from paratrain.tools.doctor.findings import Finding
from paratrain.tools.doctor.script import Script


@dataclass(frozen=True)
class Hit:
    """A mistake a check found: the node it is at, what is wrong, the fix."""

    node: ast.AST
    message: str
    fix: str
    #: False when what decides it is out of doctor's sight (shown with --all only)
    sure: bool = True


Check = Callable[[Script], Iterable[Hit]]


@dataclass(frozen=True)
class Rule:
    id: str
    summary: str
    check: Check

    def run(self, script: Script) -> list[Finding]:
        return [
            Finding(
                script.path,
                getattr(hit.node, "lineno", 0),
                self.id,
                hit.message,
                hit.fix,
                hit.sure,
            )
            for hit in self.check(script)
        ]
