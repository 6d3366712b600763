"""The first code of every process that torchrun's agent starts for paratrain
(:mod:`paratrain.launching.agent`)::

    python -m paratrain.cli.entry run SCRIPT [ARGS...]   # the user's script, as __main__
    python -m paratrain.cli.entry train                  # paratrain train, config from the env

It starts the heartbeat (and the faulthandler the hang watchdog uses) before anything else,
and catches paratrain's one-line errors: they go to the launcher once, instead of a
traceback from every rank. Under plain torchrun (no paratrain launcher) rank 0 alone prints
them. A ``UserError`` exits with code 2, any other paratrain error with 1.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from paratrain.cli.commands.train import train_in_process
from paratrain.launching import heartbeat
from paratrain.launching.agent import REPORT_VARIABLE
from paratrain.launching.parent_death import die_with_parent
from paratrain.launching.preemption import Stopped
from paratrain.runtime.facade import Runtime
from paratrain.training.elastic import worker_config
from paratrain.utils.errors import LaunchError, UserError


def report(exc: UserError | LaunchError) -> int:
    """Hand a one-line error to the launcher (or print it on rank 0); the exit code."""
    user = isinstance(exc, UserError)
    # This process dies of the error: the runtime's exit handler then leaves the group
    # without waiting for peers that may be gone (as for an uncaught exception).
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    directory = os.environ.get(REPORT_VARIABLE)
    rank = os.environ.get("RANK", "0")
    if directory:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        path = Path(directory) / f"report-a{attempt}-rank{rank}.txt"
        path.write_text(f"{'user' if user else 'launch'}\n{exc}", encoding="utf-8")
    elif rank == "0":
        print(f"paratrain: error: {exc}", file=sys.stderr)
    return 2 if user else 1


def _record(name: str, text: str) -> bool:
    """Leave ``name`` (with this attempt and rank) for the launcher; False without one."""
    directory = os.environ.get(REPORT_VARIABLE)
    if not directory:
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank = os.environ.get("RANK", "0")
    path = Path(directory) / name.format(attempt=attempt, rank=rank)
    path.write_text(text, encoding="utf-8")
    return True


def guarded(main: Callable[[], object]) -> int:
    if os.environ.get(REPORT_VARIABLE):  # started by paratrain's launcher: die with it
        die_with_parent()
    heartbeat.arm()
    _record("started-a{attempt}-rank{rank}", str(os.getpid()))
    try:
        main()
    except Stopped as exc:
        # Under paratrain's launcher: exit 0, so that the agent does not restart the
        # processes, and leave the stop for the launcher to exit with.
        if not os.environ.get(REPORT_VARIABLE):
            return int(exc.code or 1)
        if os.environ.get("RANK", "0") == "0":
            request = {"signum": exc.request.signum, "at": exc.request.at, "message": exc.message}
            _record("stopped-a{attempt}.json", json.dumps(request))
        return 0
    except (UserError, LaunchError) as exc:
        return report(exc)
    except KeyboardInterrupt:
        if not os.environ.get(REPORT_VARIABLE):
            raise
        return 130  # Ctrl-C twice, or before the loop began: the launcher says it once
    except Exception as exc:
        # Under paratrain's launcher the traceback goes to a file: when one process dies,
        # the others fail in their collectives, and a restart should not print them all.
        trace = f"{time.time()!r}\n{traceback.format_exc()}"
        if not _record("trace-a{attempt}-rank{rank}.txt", trace):
            raise
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        return 1
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
