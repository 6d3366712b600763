"""MkDocs hook: the command-line reference, rendered from the argparse definitions.

A page that holds the line ``<!-- cli-reference -->`` gets, in its place, one section per
command and subcommand of ``paratrain.cli.main.build_parser()``: its description, its usage and a
table of its options. Nothing is copied by hand, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

MARKER = "<!-- cli-reference -->"
#: usage lines are wrapped at this width, whatever the terminal that builds the site
WIDTH = 96


def on_page_markdown(markdown: str, **_: Any) -> str:
    """Replace the marker of a page with the rendered reference."""
    return markdown.replace(MARKER, render()) if MARKER in markdown else markdown


def render() -> str:
    """Every command's section, in the order of ``paratrain --help``."""
    from paratrain.cli.main import build_parser

    return "\n".join(
        _section(name, parser, summary)
        for name, parser, summary in _walk(build_parser(), "paratrain", None)
    )


def _walk(
    parser: argparse.ArgumentParser, name: str, summary: str | None
) -> Iterator[tuple[str, argparse.ArgumentParser, str | None]]:
    """This parser, then its subcommands' parsers, depth first."""
    yield name, parser, summary
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for sub, subparser in action.choices.items():
                yield from _walk(subparser, f"{name} {sub}", helps.get(sub))


def _section(name: str, parser: argparse.ArgumentParser, summary: str | None) -> str:
    formatter = argparse.HelpFormatter(prog=parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    text = [f"## `{name}`", ""]
    paragraphs = [summary] if summary else []
    if parser.description and parser.description != summary:
        paragraphs.append(parser.description)
    for paragraph in "\n\n".join(paragraphs).split("\n\n"):  # a docstring's paragraphs
        if paragraph.strip():
            text += [_escape(paragraph), ""]
    text += ["```text", formatter.format_help().strip(), "```", ""]
    rows = [_row(formatter, action) for action in parser._actions if _shown(action)]
    if rows:
        text += ["| option | what it does |", "| --- | --- |", *rows, ""]
    return "\n".join(text)


def _shown(action: argparse.Action) -> bool:
    hidden = action.help == argparse.SUPPRESS
    return not hidden and not isinstance(action, argparse._SubParsersAction | argparse._HelpAction)


def _row(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    invocation = formatter._format_action_invocation(action)
    described = formatter._expand_help(action) if action.help else ""
    notes = [_escape(described)] if described else []
    if action.choices is not None and not any(str(c) in described for c in action.choices):
        notes.append("one of " + ", ".join(f"`{choice}`" for choice in action.choices))
    if _default_worth_saying(action, described):
        notes.append(f"default: `{action.default}`")
    return f"| `{invocation}` | {'; '.join(notes)} |"


def _default_worth_saying(action: argparse.Action, described: str) -> bool:
    default = action.default
    said = "default" in described or f"({default})" in described
    if default in (None, False, argparse.SUPPRESS) or said:
        return False
    return action.option_strings != [] and not isinstance(action, argparse._StoreTrueAction)


def _escape(text: str) -> str:
    """Markdown from plain help: what markdown would read as markup is escaped, except
    inside `code spans` (the odd pieces of a split on backticks)."""
    pieces = " ".join(text.split()).split("`")
    for index in range(0, len(pieces), 2):
        piece = pieces[index]
        for char in "\\*_[]|":
            piece = piece.replace(char, "\\" + char)
        pieces[index] = piece.replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(pieces)
