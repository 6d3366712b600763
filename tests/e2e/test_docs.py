"""The README is a front page, the manual is in docs/, and CI runs what the README says.

No devices: these read files and render the command-line reference in this process.
(``mkdocs build --strict`` itself runs in CI, ``.ci/run``; the examples run in test_readme.)
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from paratrain.cli.main import build_parser, main
from paratrain.tools.doctor import styles
from paratrain.tools.doctor.findings import Style

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "cli_reference", ROOT / "docs/hooks/cli_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parsers(
    parser: argparse.ArgumentParser, name: str
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                found += _parsers(subparser, f"{name} {sub}")
    return found


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    quick_start = README.read_text("utf-8").split("## Quick start")[1]
    commands = re.search(r"```bash\n(.*?)```", quick_start, re.DOTALL)
    assert commands is not None
    install_and_run, test = commands.group(1).strip().splitlines()
    assert install_and_run == "pip install torch==2.13.0 -e . && paratrain train"
    ci = (ROOT / ".ci" / "run").read_text("utf-8").strip().splitlines()[-1]
    assert ci == test.replace("pip install ", "pip install -q ", 1)
    assert "mkdocs build --strict" in test and ".[dev,docs]" in test


def test_the_readme_is_a_front_page_whose_links_lead_somewhere() -> None:
    text = README.read_text("utf-8")
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 15  # the feature table links into the manual
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_the_cli_reference_names_every_command_and_option() -> None:
    text = _hook().render()
    for name, parser in _parsers(build_parser(), "paratrain"):
        assert f"## `{name}`" in text
        for action in parser._actions:
            for option in action.option_strings:
                if action.help != argparse.SUPPRESS and option not in ("-h", "--help"):
                    assert f"`{option}" in text or f", {option}" in text, (name, option)


def test_the_cli_reference_replaces_only_its_marker() -> None:
    hook = _hook()
    page = "# Reference\n\n<!-- cli-reference -->\n"
    rendered = hook.on_page_markdown(page, page=None, config=None, files=None)
    assert rendered.startswith("# Reference\n\n## `paratrain`") and hook.MARKER not in rendered
    assert hook.on_page_markdown("# Other\n", page=None) == "# Other\n"


def test_doctor_points_at_pages_and_sections_that_exist() -> None:
    pointers = [value.section for value in vars(styles).values() if isinstance(value, Style)]
    assert len(pointers) == 9  # FSDP / tensor-parallel and DeepSpeed scripts too
    for pointer in pointers:
        page, _, section = pointer.partition(", ")
        text = (ROOT / page).read_text("utf-8")
        assert not section or f"\n## {section.strip(chr(34))}\n" in text, pointer


def test_no_unexplained_seed_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    """The blog posts paratrain grew from ("seed 004") mean nothing to a reader: the manual
    names what a script is instead, and `paratrain recipes` says what a recipe trains."""
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    said = [page.name for page in pages if re.search(r"seed[ -]?0\d\d\b(?!_)", page.read_text())]
    assert said == ["speed.md"]  # the `seed-004` contender, explained where it is named
    assert main(["recipes"]) == 0
    assert "seed 0" not in capsys.readouterr().out
