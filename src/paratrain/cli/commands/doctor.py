"""`paratrain doctor SCRIPT.py`: a training script's classic mistakes, found without running it.

Exit codes: 0 when every script is clean, 1 when there are findings, 2 for a file that is
not a readable Python script.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from paratrain.tools.doctor import RULES, Diagnosis, diagnose
from paratrain.tools.doctor.explain import explain
from paratrain.utils.errors import UserError


def register(subparsers: Any) -> None:
    rules = ", ".join(rule.id for rule in RULES)
    parser = subparsers.add_parser(
        "doctor",
        help="find the classic mistakes of a training script (reads it, never runs it)",
        description="Read training scripts with ast (they never run) and report each classic "
        f"mistake with file:line, what is wrong and the fix. Rules: {rules} (--explain RULE "
        "for one). Exit code: 0 clean, 1 findings, 2 a file that is not a readable Python "
        "script.",
    )
    parser.add_argument("scripts", nargs="*", metavar="SCRIPT.py", help="the scripts to read")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--explain", metavar="RULE", help="print a rule's rationale, an example and the fix"
    )
    parser.set_defaults(handler=run)


def _text(diagnosis: Diagnosis) -> str:
    lines = [finding.text() for finding in diagnosis.findings]
    count = len(diagnosis.findings)
    summary = f"{count} finding{'s' if count != 1 else ''}" if count else "no findings"
    style = diagnosis.style
    lines.append(f"{diagnosis.path}: {summary}; {style.description}: see {style.section}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.explain is not None:
        print(explain(args.explain))
        return 0
    if not args.scripts:
        raise UserError("name the scripts to read (paratrain doctor train.py), or --explain RULE")
    diagnoses = [diagnose(path) for path in args.scripts]  # a bad file stops before any output
    total = sum(len(d.findings) for d in diagnoses)
    if args.json:
        print(
            json.dumps({"scripts": [d.to_dict() for d in diagnoses], "findings": total}, indent=2)
        )
    else:
        print("\n".join(_text(d) for d in diagnoses))
    return 1 if total else 0
