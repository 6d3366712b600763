"""Run every rule over one script."""

from __future__ import annotations

from pathlib import Path

from paratrain.doctor import styles
from paratrain.doctor.findings import Diagnosis
from paratrain.doctor.rules import RULES
from paratrain.doctor.script import Script


def diagnose_script(script: Script) -> Diagnosis:
    findings = sorted({f for rule in RULES for f in rule.run(script)})
    return Diagnosis(script.path, styles.detect(script), findings)


def diagnose(path: str | Path) -> Diagnosis:
    """Read ``path`` with ``ast`` (it never runs) and report its classic mistakes.

    Raises ``UserError`` for a file that is not a readable Python script.
    """
    return diagnose_script(Script.read(path))


def diagnose_source(source: str, path: str = "<script>") -> Diagnosis:
    return diagnose_script(Script.parse(source, path))
