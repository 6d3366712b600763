"""What several test modules share: the command line run in a new process or this one
(``cli``), processes seen from outside (``processes``), archives of fake CIFAR-10 batches
(``archives``). Importable as ``helpers`` because pytest puts ``tests/`` on ``sys.path`` for
``tests/conftest.py``.

Importing the package puts the tests' fault-injection plug-in (``tests/plugins``) on the
path of this process and, through ``PYTHONPATH``, of every process the tests start: the
plug-in is what the suite's ``PARATRAIN_TEST_*`` variables drive.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
if str(PLUGINS) not in sys.path:
    sys.path.insert(0, str(PLUGINS))
if str(PLUGINS) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(PLUGINS), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
