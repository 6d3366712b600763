"""Fault injection points: where a test makes a run fail as a cluster or a GPU would.

Production code calls a point at the moment such a fault strikes; the point does nothing
unless a handler was registered for it, so a run without one pays a dictionary look-up and
reads no environment variable. Handlers come from plug-ins: entry points of the group
``paratrain.plugins``, each a callable without arguments that calls :func:`register`. They
are loaded once per process, when a point is first reached: the ``paratrain`` command,
spawned ranks, torchrun's workers and bench workers alike, as each imports paratrain. The
test suite's plug-in is ``tests/plugins/`` (docs/development.md, "Fault injection").

The points, when each is reached, and what its handler takes and returns:

* ``at_step``: a micro-batch's loss, before its backward: ``(rank, step, loss) -> loss``
  (``step``: the optimizer step, 1-based);
* ``oom``: the end of the forward of a piece under ``--oom auto``:
  ``(rank, samples, step) -> None``; raising ``torch.OutOfMemoryError`` runs out of memory;
* ``compiled_grads``: the gradients the compiled backward added on the step the compile
  check compares: ``(grads) -> grads`` (a list, one per parameter);
* ``checkpoint_written``: a checkpoint written under its temporary name, before it is
  renamed into place: ``(path) -> None``;
* ``busy_cores``: before the cores other work keeps busy are looked at:
  ``() -> float | None`` (None: look at the machine).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: the entry-point group of plug-ins
GROUP = "paratrain.plugins"
POINTS = ("at_step", "oom", "compiled_grads", "checkpoint_written", "busy_cores")

Handler = Callable[..., Any]

#: point -> handler; None until this process loaded its plug-ins
_handlers: dict[str, Handler] | None = None


def handlers() -> dict[str, Handler]:
    """The registered handlers, plug-ins loaded first (once)."""
    global _handlers
    if _handlers is None:
        _handlers = {}
        _load_plugins()
    return _handlers


def _load_plugins() -> None:
    if not _declared():
        return
    from importlib.metadata import entry_points

    for entry in entry_points(group=GROUP):
        try:
            entry.load()()
        except Exception as exc:
            raise RuntimeError(f"paratrain plug-in {entry.name} = {entry.value}: {exc}") from exc


def _declared() -> bool:
    """Whether a distribution on ``sys.path`` declares a plug-in: a look at the
    ``entry_points.txt`` of its metadata folders (``*.dist-info``, ``*.egg-info``: what pip
    installs, editable installs included), as importing importlib.metadata alone would cost
    every ``paratrain`` command about 30 ms of CPU before it starts."""
    for folder in sys.path:
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            try:
                with open(os.path.join(folder or ".", name, "entry_points.txt"), "rb") as f:
                    if b"[" + GROUP.encode() + b"]" in f.read():
                        return True
            except OSError:
                continue
    return False


def register(point: str, handler: Handler | None) -> Handler | None:
    """Run ``handler`` at ``point`` from now on (None: nothing runs there); returns the
    handler it replaces. Plug-ins are loaded first, so this one wins over theirs."""
    if point not in POINTS:
        raise ValueError(f"no fault injection point {point!r}: use one of {', '.join(POINTS)}")
    table = handlers()
    previous = table.pop(point, None)
    if handler is not None:
        table[point] = handler
    return previous


@contextmanager
def injected(point: str, handler: Handler) -> Iterator[None]:
    """``handler`` at ``point`` inside the ``with`` block; the previous one after it."""
    previous = register(point, handler)
    try:
        yield
    finally:
        register(point, previous)


def at_step(rank: int, step: int, loss: Any) -> Any:
    # at every micro-batch: the loaded handlers without a call, once they are
    handler = (handlers() if _handlers is None else _handlers).get("at_step")
    return loss if handler is None else handler(rank, step, loss)


def oom(rank: int, samples: int, step: int) -> None:
    handler = handlers().get("oom")
    if handler is not None:
        handler(rank, samples, step)


def compiled_grads(grads: list[Any]) -> list[Any]:
    handler = handlers().get("compiled_grads")
    return grads if handler is None else list(handler(grads))


def checkpoint_written(path: Path) -> None:
    handler = handlers().get("checkpoint_written")
    if handler is not None:
        handler(path)


def busy_cores() -> float | None:
    handler = handlers().get("busy_cores")
    found = None if handler is None else handler()
    return None if found is None else float(found)
