"""The README and the manual in ``docs/`` are what users copy: their Python examples must run.

Every ```python block of README.md and of docs/**/*.md runs (``exec``), unless the comment
line just above it says otherwise:

    <!-- readme-test: run; doctor=STYLE -->        runs; `paratrain doctor` must recognise
                                                   STYLE, and find nothing in a paratrain
                                                   example (what it finds in the "before"
                                                   examples is pinned in test_doctor_corpus)
    <!-- readme-test: script; doctor=STYLE -->     runs as its own file (``python block.py``),
                                                   for examples that start processes under a
                                                   ``__main__`` guard
    <!-- readme-test: parse-only (REASON); doctor=STYLE -->
                                                   only parsed and read by doctor: a "before"
                                                   example of a library paratrain does not
                                                   install (Accelerate, Fabric, Horovod) or
                                                   that needs GPUs

Which blocks are parse-only is pinned below, so that none becomes so by accident.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import subprocess_env

from paratrain.tools.doctor import diagnose_source

ROOT = Path(__file__).resolve().parents[2]
#: the README, then the manual's pages in a fixed order
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- readme-test: ([^>]*?) -->\n)?```python\n(.*?)```", re.DOTALL)
#: (page, marker, code) of every Python block
BLOCKS = [
    (page.relative_to(ROOT).as_posix(), m.group(1) or "run", m.group(2))
    for page in PAGES
    for m in BLOCK.finditer(page.read_text("utf-8"))
]
#: the "before" examples that cannot run here, by the style doctor must recognise in them
PARSE_ONLY = ["ddp", "accelerate", "fabric", "horovod"]


def _mode(marker: str) -> tuple[str, str | None]:
    """``("run" | "script" | "parse-only", doctor style or None)`` of a block's marker."""
    mode = marker.split(";")[0].split("(")[0].strip()
    style = re.search(r"doctor=(\w+)", marker)
    assert mode in ("run", "script", "parse-only"), marker
    assert mode != "parse-only" or "(" in marker, f"say why a block is not run: {marker}"
    return mode, style.group(1) if style else None


def _name(index: int) -> str:
    """``docs/porting.md block 3``: the page and the block's number on it."""
    page = BLOCKS[index][0]
    return f"{page} block {[p for p, _, _ in BLOCKS[:index]].count(page)}"


#: the extra a block's imports need, by the module it imports
EXTRAS = {
    "ray": "tune",
    "transformers": "hf",
    "torchao": "export",
    "webdataset": "stream",
    "timm": "timm",
}


def _param(index: int) -> object:
    """The block's index; marked slow where the block starts processes (a script, Ray), and
    skipped where it imports an extra this machine has not installed."""
    _, marker, code = BLOCKS[index]
    starts_processes = marker.split(";")[0].strip() == "script" or "import ray" in code
    marks = [pytest.mark.slow] if starts_processes else []
    for module, extra in EXTRAS.items():
        imported = re.search(rf"^\s*(import|from) {module}\b", code, re.MULTILINE)
        if imported and importlib.util.find_spec(module) is None:
            marks.append(pytest.mark.skip(reason=f"needs pip install 'paratrain[{extra}]'"))
    return pytest.param(index, marks=marks)


@pytest.mark.parametrize("index", [_param(i) for i in range(len(BLOCKS))], ids=_name)
def test_readme_python_example_runs(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block runs in a folder of its own, as a user's would: what it writes (``runs/``)
    lands there, not in the checkout, and the folders it asks ``tempfile`` for are removed
    afterwards (in a short temporary folder: a fork server's socket path has a length limit
    that one under ``tmp_path`` passes)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with tempfile.TemporaryDirectory() as temporary:
        monkeypatch.setattr(tempfile, "mkdtemp", _mkdtemp_in(temporary))
        _run_block(index, tmp_path, work, temporary)


def _mkdtemp_in(folder: str) -> Callable[..., str]:
    """``tempfile.mkdtemp`` whose folders go to ``folder`` when the caller names neither a
    folder nor a prefix: the example's own, not the fork server's (``pymp-``), which this
    process keeps for later tests."""
    mkdtemp = tempfile.mkdtemp

    def inside(suffix: Any = None, prefix: Any = None, dir: Any = None) -> str:
        return mkdtemp(suffix, prefix, folder if dir is None and prefix is None else dir)

    return inside


def _run_block(index: int, tmp_path: Path, work: Path, temporary: str) -> None:
    _, marker, code = BLOCKS[index]
    mode, style = _mode(marker)
    compiled = compile(code, _name(index), "exec")
    if style is not None:
        diagnosis = diagnose_source(code, _name(index))
        assert diagnosis.style.name == style
        if style == "paratrain":
            assert diagnosis.findings == []
    if mode == "run":
        exec(compiled, {"__name__": "readme"})
    elif mode == "script":
        script = tmp_path / f"block{index}.py"
        script.write_text(code, encoding="utf-8")
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=work,
            env=subprocess_env(TMPDIR=temporary),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-3000:]


def test_only_the_foreign_before_examples_are_parse_only() -> None:
    parse_only = [_mode(marker) for _, marker, _ in BLOCKS if marker.startswith("parse-only")]
    assert [style for _, style in parse_only] == PARSE_ONLY


def test_every_migration_has_a_checked_before_and_after() -> None:
    styles = [_mode(marker)[1] for _, marker, _ in BLOCKS]
    for source in ("plain", "dataparallel", "ddp", "accelerate", "fabric", "horovod"):
        assert source in styles
        assert styles[styles.index(source) + 1] == "paratrain", f"no after-example for {source}"
