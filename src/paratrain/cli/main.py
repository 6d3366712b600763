"""The `paratrain` command: parse arguments, build a config, call one function."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from paratrain.cli.commands import COMMAND_MODULES
from paratrain.launching.preemption import Stopped, stop_before_start
from paratrain.launching.rank_start import fork_from_this_process
from paratrain.utils import environment
from paratrain.utils.atomic import FULL
from paratrain.utils.errors import LaunchError, UserError
from paratrain.version import __version__


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see: {self.prog} --help)")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Also note the innermost (sub)command that parsed (``_PROG``), so that an argument
        nobody knows points at that command's ``--help``, not at ``paratrain --help``."""
        parsed, extras = super().parse_known_args(args, namespace)
        if not hasattr(parsed, _PROG):  # set by a subcommand's parser first, kept here
            setattr(parsed, _PROG, self.prog)
        return parsed, extras


#: the namespace attribute naming the (sub)command that parsed the arguments
_PROG = "_paratrain_prog"


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The arguments of one command; an unknown one is refused naming that command's help."""
    args, extras = build_parser().parse_known_args(argv)
    prog = vars(args).pop(_PROG, "paratrain")
    if extras:
        raise UserError(f"unrecognized arguments: {' '.join(extras)} (see: {prog} --help)")
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="paratrain",
        description="Train PyTorch models on any device layout with the same code.",
    )
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"paratrain.cli.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; user errors become one line on stderr and exit code 2."""
    try:
        args = parse(argv)
        return int(args.handler(args))
    except UserError as exc:
        _error(exc)
        return 2
    except LaunchError as exc:
        _error(exc)
        return 1
    except Stopped as exc:  # stopped on a signal; the main process printed its line
        return int(exc.code or 1)
    except BrokenPipeError:  # `paratrain recipes | head`: the reader is gone, nothing to say
        _silence_stdout()
        return 141  # as the shell reports a process ended by SIGPIPE
    except OSError as exc:  # a full disk, a folder not writable: one line, not a traceback
        _error(UserError(exc.strerror if exc.errno in FULL and exc.strerror else _os_error(exc)))
        return 2
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Send what is left to /dev/null, so that Python's flush at exit does not complain."""
    # no file descriptor: a test's stdout
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _os_error(exc: OSError) -> str:
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def _error(exc: Exception) -> None:
    """One line on stderr; under torchrun from one process only, not once per process (every
    process meets the same bad input)."""
    from paratrain.distributed.once import tell_once

    if tell_once("error"):
        print(f"paratrain: error: {exc}", file=sys.stderr, flush=True)
    if not environment.current().is_rank_zero:
        # Dying of it: the runtime's exit handler leaves the group without waiting for peers.
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__


def entry() -> None:
    """The ``paratrain`` command (and ``python -m paratrain``)."""
    if sys.argv[1:2] in (["train"], ["run"]):  # the commands that train: a stop is theirs
        # Under plain torchrun every process gets the signal: rank 0 says it.
        stop_before_start(lambda: environment.current().is_rank_zero)
    fork_from_this_process()  # this process does no parallel work before it launches
    sys.exit(main())
