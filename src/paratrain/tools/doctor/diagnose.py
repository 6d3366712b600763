"""Run every rule over one script."""

from __future__ import annotations

from pathlib import Path

from paratrain.tools.doctor import styles
from paratrain.tools.doctor.findings import Diagnosis
from paratrain.tools.doctor.rules import RULES
from paratrain.tools.doctor.script import Script
from paratrain.utils.errors import UserError


def diagnose_script(script: Script) -> Diagnosis:
    try:
        findings = sorted({f for rule in RULES for f in rule.run(script)})
    except RecursionError:  # an expression Python parsed, but too deep to print back
        raise UserError(
            f"{script.path}: cannot read it: an expression is nested too deeply (split it into "
            "several statements)"
        ) from None
    return Diagnosis(script.path, styles.detect(script), findings)


def diagnose(path: str | Path) -> Diagnosis:
    """Read ``path`` with ``ast`` (it never runs) and report its classic mistakes.

    Raises ``UserError`` for a file that is not a readable Python script.
    """
    return diagnose_script(Script.read(path))


def diagnose_source(source: str, path: str = "<script>") -> Diagnosis:
    return diagnose_script(Script.parse(source, path))
