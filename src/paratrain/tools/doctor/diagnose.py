"""Run every rule over one script, or over every script of a folder."""

from __future__ import annotations

from pathlib import Path

from paratrain.tools.doctor import styles
from paratrain.tools.doctor.findings import Diagnosis
from paratrain.tools.doctor.project import Project
from paratrain.tools.doctor.ranks import is_entry
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
    return Diagnosis(
        script.path,
        styles.detect(script),
        [f for f in findings if f.sure],
        [f for f in findings if not f.sure],
        is_entry(script),
    )


def diagnose(path: str | Path, project: Project | None = None) -> Diagnosis:
    """Read ``path`` with ``ast`` (it never runs), with the local modules it imports, and
    report its classic mistakes. ``project`` shares what was read between the scripts of one
    folder (by default the project is the script's own folder).

    Raises ``UserError`` for a file that is not a readable Python script.
    """
    project = project or Project(Path(path).parent)
    return diagnose_script(project.script(Path(path)))


def diagnose_source(source: str, path: str = "<script>") -> Diagnosis:
    return diagnose_script(Script.parse(source, path))


#: folders that hold no code of the project (environments, caches, version control)
_SKIPPED = {"__pycache__", "node_modules", "site-packages", "venv", "env"}


def python_files(folder: Path) -> list[Path]:
    """Every ``.py`` file under ``folder``, in order, outside hidden folders and
    environments."""
    return sorted(
        path
        for path in folder.rglob("*.py")
        if not any(
            part.startswith(".") or part in _SKIPPED for part in path.relative_to(folder).parts[:-1]
        )
    )


def diagnose_paths(paths: list[str]) -> tuple[list[Diagnosis], list[str]]:
    """Each script given, and every ``.py`` of each folder given (read as one project: its
    modules import one another). Returns the diagnoses, and one line for each file of a
    folder Python cannot read (skipped: a repository keeps Python 2 or generated files); a
    ``UserError`` for a path that is neither, or a script named that Python cannot read."""
    diagnoses: list[Diagnosis] = []
    skipped: list[str] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            project = Project(path)
            for file in python_files(path):
                try:
                    diagnoses.append(diagnose(file, project))
                except UserError as exc:
                    skipped.append(f"skipped {exc}")
        elif path.exists() or path.suffix == ".py":
            diagnoses.append(diagnose(path))
        else:
            raise UserError(f"{path}: no such file or folder")
    return diagnoses, skipped
