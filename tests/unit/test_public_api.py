"""The public API does not change by accident (`--strategy cpu`, no processes started).

``tests/public_api.txt`` lists ``paratrain.__all__``, the signatures of ``Runtime``'s
public methods and properties, of ``load_weights`` and ``strategies()``, and the
subcommands of ``paratrain``. A change that alters one of them fails here; when the change
is meant, regenerate the listing with ``python tests/unit/test_public_api.py`` and review the
diff like any other.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import paratrain
from paratrain.cli.main import build_parser

EXPECTED = Path(__file__).parents[1] / "public_api.txt"


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return sorted(action.choices)
    raise AssertionError("the paratrain parser has no subcommands")


def listing() -> str:
    """The public API as text, one line per name."""
    lines = [f"__all__: {', '.join(sorted(paratrain.__all__))}"]
    runtime = paratrain.Runtime
    # the facade's methods may live on helper base classes: read the whole MRO's public names
    public = {n for n in dir(runtime) if not n.startswith("_")} | {"__init__"}
    for name in sorted(public):
        member = inspect.getattr_static(runtime, name)
        if isinstance(member, property):
            lines.append(f"Runtime.{name}: property -> {inspect.signature(member.fget)}")
        elif isinstance(member, classmethod | staticmethod):
            kind = type(member).__name__
            lines.append(f"Runtime.{name}: {kind}{inspect.signature(member.__func__)}")
        elif callable(member):
            lines.append(f"Runtime.{name}{inspect.signature(member)}")
        else:
            lines.append(f"Runtime.{name}: {type(member).__name__}")
    lines.append(f"load_weights{inspect.signature(paratrain.load_weights)}")
    lines.append(f"strategies{inspect.signature(paratrain.strategies)}")
    lines.append(f"strategies() == {paratrain.strategies()}")
    lines.append(f"paratrain subcommands: {', '.join(_subcommands(build_parser()))}")
    return "\n".join(lines) + "\n"


def test_the_public_api_is_the_listed_one() -> None:
    expected = EXPECTED.read_text()
    actual = listing()
    assert actual == expected, (
        "the public API changed; if that is meant, run `python tests/unit/test_public_api.py` "
        "and commit tests/public_api.txt"
    )


def test_the_listing_sees_a_change() -> None:
    """The comparison is not vacuous: a renamed parameter shows in the listing."""
    original = paratrain.Runtime.barrier

    def barrier(self, timeout: float = 1.0) -> None: ...

    paratrain.Runtime.barrier = barrier  # type: ignore[method-assign]
    try:
        assert "Runtime.barrier(self, timeout: 'float' = 1.0) -> 'None'" in listing()
    finally:
        paratrain.Runtime.barrier = original  # type: ignore[method-assign]
    assert listing() == EXPECTED.read_text()


if __name__ == "__main__":
    EXPECTED.write_text(listing())
    sys.stdout.write(listing())
