"""`paratrain doctor SCRIPT.py`: a training script's classic mistakes, found without running it.

Exit codes: 0 when every script is clean, 1 when there are findings, 2 for a file that is
not a readable Python script.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from paratrain.tools.doctor import RULES, Diagnosis
from paratrain.tools.doctor.diagnose import diagnose_paths
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
    parser.add_argument(
        "scripts",
        nargs="*",
        metavar="PATH",
        help="the scripts to read, or folders (every .py in them, read as one project)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--all",
        action="store_true",
        help="also the findings doctor is not sure of (what decides them is out of its sight)",
    )
    parser.add_argument(
        "--explain", metavar="RULE", help="print a rule's rationale, an example and the fix"
    )
    parser.set_defaults(handler=run)


def _text(diagnosis: Diagnosis, every: bool) -> str:
    shown = diagnosis.shown(every)
    lines = [finding.text() for finding in shown]
    count = len(shown)
    summary = f"{count} finding{'s' if count != 1 else ''}" if count else "no findings"
    hidden = len(diagnosis.unsure) if not every else 0
    if hidden:
        summary += f" ({hidden} more unsure: --all)"
    style = diagnosis.style
    lines.append(f"{diagnosis.path}: {summary}; {style.description}: see {style.section}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.explain is not None:
        print(explain(args.explain))
        return 0
    if not args.scripts:
        raise UserError("name the scripts to read (paratrain doctor train.py), or --explain RULE")
    diagnoses, skipped = diagnose_paths(args.scripts)  # a bad script stops before any output
    for line in skipped:
        print(line, file=sys.stderr)
    total = sum(len(d.shown(args.all)) for d in diagnoses)
    if args.json:
        scripts = [d.to_dict(args.all) for d in diagnoses]
        print(json.dumps({"scripts": scripts, "findings": total}, indent=2))
    else:
        # A module of a folder with nothing to say is left out; scripts named are listed
        named = {str(Path(p)) for p in args.scripts}
        said = [d for d in diagnoses if d.entry or d.shown(args.all) or d.path in named]
        print("\n".join(_text(d, args.all) for d in said or diagnoses))
    return 1 if total else 0
