"""The first code of every process that torchrun's agent starts for paratrain
(:mod:`paratrain.launching.agent`)::

    python -m paratrain.cli.entry run SCRIPT [ARGS...]   # the user's script, as __main__
    python -m paratrain.cli.entry train                  # paratrain train, config from the env

It starts the heartbeat (and the faulthandler the hang watchdog uses) before anything else,
and catches paratrain's one-line errors: they go to the launcher once, instead of a
traceback from every rank. Under plain torchrun (no paratrain launcher) the first process
to fail prints them (see :mod:`paratrain.distributed.once`). A ``UserError`` exits with
code 2, any other paratrain error with 1.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from paratrain.cli.commands.train import train_in_process
from paratrain.launching import heartbeat
from paratrain.launching.launcher import (
    leave_now,
    report_failure,
    report_started,
    report_stop,
    reporting,
    say_one_line,
)
from paratrain.launching.parent_death import die_with_parent
from paratrain.launching.preemption import Stopped
from paratrain.runtime.facade import Runtime
from paratrain.training.elastic import worker_config
from paratrain.utils.errors import LaunchError, UserError


def guarded(main: Callable[[], object]) -> int:
    if reporting():  # started by paratrain's launcher: die with it
        die_with_parent()
    heartbeat.arm()
    report_started()
    try:
        main()
    except Stopped as exc:
        # Under paratrain's launcher: exit 0, so that the agent does not restart the
        # processes, and leave the stop for the launcher to exit with.
        if not report_stop(exc):
            return int(exc.code or 1)
        return 0
    except (UserError, LaunchError) as exc:
        leave_now(say_one_line(exc))
    except KeyboardInterrupt:
        if not reporting():
            raise
        return 130  # Ctrl-C twice, or before the loop began: the launcher says it once
    except Exception as exc:
        # Under paratrain's launcher the traceback goes to a report: when one process dies,
        # the others fail in their collectives, and a restart should not print them all.
        # Then the program's exit handlers, and no interpreter finalization, where gloo's
        # threads may abort the process with one more line on stderr.
        code = report_failure(exc)
        if code is None:
            raise
        leave_now(code, exit_handlers=True)
    return 0


def run_script(argv: Sequence[str]) -> None:
    script, *args = argv
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def train_worker() -> None:
    """One process of ``paratrain train`` under the agent; after a restart it continues
    from the run's newest complete checkpoint."""
    cfg, directory = worker_config()
    Runtime.from_config(cfg.runtime_config()).launch(train_in_process, cfg, directory)


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["run"]:
        return guarded(lambda: run_script(argv[1:]))
    if argv[:1] == ["train"]:
        return guarded(train_worker)
    print(f"paratrain.cli.entry: unknown command {' '.join(argv[:1])}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
