"""Option helpers the subcommands share: old spellings kept working without being shown."""

from __future__ import annotations

import argparse
from typing import Any

from paratrain.utils.errors import UserError


def hidden_alias(p: argparse.ArgumentParser, *names: str, dest: str, **kwargs: Any) -> None:
    """``names`` set ``dest`` as its shown option does; ``--help`` lists only the shown one
    (an older spelling that scripts may still use)."""
    p.add_argument(*names, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


def one_device(value: str | None, command: str) -> str | None:
    """``--devices`` of a command that measures one device: a list of one, or refused."""
    if value is not None and "," in value:
        raise UserError(
            f"--devices {value}: {command} measures one device; give one, e.g. --devices cuda:1 "
            f"(see: {command} --help)"
        )
    return value
