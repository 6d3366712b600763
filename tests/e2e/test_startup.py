"""Starting fast: `paratrain --help` imports no torch, and `import paratrain` (with every
public name used) loads none of the slow torch subsystems (compiler, DTensor, FSDP,
pipelining) until a run needs them. Checked by what a fresh interpreter has imported, not by
timing; benchmarks/startup.py prints the times. No devices: nothing is trained here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import paratrain
from paratrain.cli.commands import COMMAND_MODULES
from paratrain.strategies import describe_strategies
from paratrain.training.recipes import recipe_names
from paratrain.utils.catalog import RECIPES, STRATEGIES

#: every parser the command line has, subcommands of subcommands included
HELPS = [
    [],
    *([name] for name in COMMAND_MODULES),
    ["ckpt", "inspect"],
    ["ckpt", "convert"],
    ["bench", "placement"],
    ["bench", "crossover"],
    ["bench", "loader"],
    ["data", "shard"],
]

#: torch subsystems that take seconds to import and that only some runs use
SLOW = (
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
)

_HELP_CHILD = """
import contextlib, io, json, sys
from paratrain.cli.main import main
failed = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*argv, "--help"])
            failed.append([argv, "no exit"])
        except SystemExit as exc:
            if exc.code != 0 or "usage: paratrain" not in out.getvalue():
                failed.append([argv, exc.code])
loaded = [m for m in ("torch", "numpy", "safetensors") if m in sys.modules]
print(json.dumps({"failed": failed, "loaded": loaded}))
"""

_IMPORT_CHILD = """
import json, sys
import paratrain
for name in paratrain.__all__:
    getattr(paratrain, name)
paratrain.strategies()
print(json.dumps(sorted(m for m in sys.modules if m.startswith("torch"))))
"""


def _child(code: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return done.stdout


@pytest.mark.slow
def test_every_help_is_printed_without_importing_torch() -> None:
    result = json.loads(_child(_HELP_CHILD, json.dumps(HELPS)))
    assert result["failed"] == []
    assert result["loaded"] == []


@pytest.mark.slow
def test_import_paratrain_loads_no_slow_torch_subsystem() -> None:
    loaded = json.loads(_child(_IMPORT_CHILD))
    assert "torch" in loaded  # the public names were really imported
    assert [m for m in loaded if m.startswith(SLOW)] == []


def test_the_catalog_names_what_the_registries_hold() -> None:
    # `--help` reads the catalog; a strategy or recipe added without it would be missing there
    assert describe_strategies() == STRATEGIES
    assert recipe_names() == list(RECIPES)


def test_lazy_public_names_are_the_real_objects() -> None:
    from paratrain.checkpoints.files import load_weights
    from paratrain.runtime.facade import Runtime

    assert paratrain.Runtime is Runtime
    assert paratrain.load_weights is load_weights
    assert set(paratrain.__all__) <= set(dir(paratrain))
    # the subpackage paratrain.strategies, imported by now, does not shadow the function
    assert callable(paratrain.strategies)
    assert paratrain.strategies()[0] == "auto"
    assert "paratrain.strategies" in sys.modules
