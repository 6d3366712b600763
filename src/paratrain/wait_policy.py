"""``OMP_WAIT_POLICY=PASSIVE`` for the process the ``paratrain`` command runs in.

Imported first by the package, for its side effect: OpenMP reads its wait policy once,
when torch is imported, and `paratrain train --strategy cpu` trains in this very process.
Spinning waiters on a machine with other busy processes make training ~100x slower;
sleeping ones cost a few times at most (see :mod:`paratrain.threads`). Only the command
line (``paratrain ...``, ``python -m paratrain``): a script that imports paratrain keeps
its own setting. A policy the user set is kept.
"""

from __future__ import annotations

import os
import sys


def is_the_command() -> bool:
    """Whether this interpreter runs the ``paratrain`` command (``python -m paratrain`` is
    being imported while ``sys.argv[0]`` still reads ``-m``)."""
    first = sys.argv[0] if sys.argv else ""
    return first == "-m" or os.path.basename(first) == "paratrain"


if is_the_command() and "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
