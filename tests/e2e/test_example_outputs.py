"""The documentation's examples write under runs/ (ignored by git) or a temporary folder, so
running them from a checkout leaves nothing to commit by mistake. Every weights, chart or
job file an example names (``.safetensors``, ``.pt``, ``.png``, ``.sbatch``...) is under
``runs/``, absolute, or joined to a folder variable (``tmp / "dp.pt"``); a ``parse-only``
block (someone else's script, never run) is exempt."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from conftest import REPO

BLOCK = re.compile(r"(?:<!-- readme-test: ([^>]*?) -->\n)?```(python|bash)\n(.*?)```", re.DOTALL)
#: a relative file name with an output suffix, not part of a longer path or a joined one
OUTPUT = re.compile(
    r"""(?<![\w/.$-])(?<!/ ")(?<!/ ')"""
    r"""([\w.-]+(?:/[\w.*-]+)*\.(?:safetensors|pt|pth|png|sbatch|ckpt|bin|onnx))\b"""
)


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def ignored(name: str) -> bool:
    """Whether ``name`` (relative to the repository root) is ignored by a root pattern of
    ``.gitignore``: one that matches its first part (``/*.pt``, ``/runs/``)."""
    lines = (REPO / ".gitignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip().strip("/") for line in lines if line.strip().startswith("/")]
    first = name.split("/")[0]
    return any(fnmatch.fnmatchcase(first, pattern) for pattern in patterns)


def files_named(text: str) -> list[str]:
    """Relative output files named in the code blocks of ``text`` (comments left out)."""
    named = []
    for marker, _language, code in BLOCK.findall(text):
        if marker.startswith("parse-only"):
            continue
        for line in code.splitlines():
            named += OUTPUT.findall(line.split("#")[0])
    return named


def test_examples_write_under_runs_or_ignored_names() -> None:
    stray = [
        f"{path.name}: {name}"
        for path in documents()
        for name in files_named(path.read_text(encoding="utf-8"))
        if not name.startswith("runs/")
    ]
    assert stray == [], stray
    assert ignored("runs/model.safetensors")  # and git ignores runs/


def test_the_check_sees_a_stray_file() -> None:
    block = "```bash\nparatrain export runs/x --int8 --out q.onnx\n```\n"
    assert files_named(block) == ["q.onnx"] and not ignored("q.onnx")
    joined = '```python\ntorch.save(m, tmp / "dp.pt")  # out.pt\n```\n'
    assert files_named(joined) == []
    assert ignored("w.safetensors") and ignored("runs/a.pt") and ignored("mlruns/0/meta.yaml")
    assert not ignored("out/w.pt") and not ignored("plan.png")
