"""How rt.launch starts its processes (paratrain.launching.rank_start): paratrain's command
forks them itself while its process is clean, anything else goes through the fork server.
Checked in fresh interpreters (this test process has threads of its own)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import subprocess_env

pytestmark = pytest.mark.slow  # fresh interpreters that import torch

_PROBE = """
import sys, threading, time
import torch
from paratrain.launching import rank_start

said = [rank_start.start_method()]
rank_start.fork_from_this_process()
said.append(rank_start.start_method())
if sys.argv[1] == "parallel":
    torch.set_num_threads(2)
    torch.randn(256, 256) @ torch.randn(256, 256)  # starts the OpenMP pool
elif sys.argv[1] == "thread":
    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
elif sys.argv[1] == "asked":
    import os
    from paratrain.utils import environment
    environment.replace({**os.environ, "PARATRAIN_START_METHOD": "forkserver"})
said.append(rank_start.start_method())
print(" ".join(said))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork is Linux's")
@pytest.mark.parametrize(
    ("then", "expected"),
    [
        ("nothing", "forkserver fork fork"),
        ("parallel", "forkserver fork forkserver"),
        ("thread", "forkserver fork forkserver"),
        ("asked", "forkserver fork forkserver"),
    ],
)
def test_the_command_forks_only_while_it_is_clean(then: str, expected: str) -> None:
    """A program forks its ranks itself only once paratrain's command said it may, and only
    while no thread (an OpenMP pool, a Python thread) has started; the environment can ask
    for the fork server."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, then],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected.split()


_START_METHODS = """
import multiprocessing
import torch
import paratrain

METHODS = ["fork", "forkserver", "spawn"]

def start_method(rt):
    mine = torch.tensor([METHODS.index(multiprocessing.get_start_method())])
    return " ".join(METHODS[int(t)] for t in rt.all_gather(mine))

if __name__ == "__main__":
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu")
    print(rt.launch(start_method))
    multiprocessing.set_start_method("spawn", force=True)
    print(rt.launch(start_method))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork is Linux's")
def test_ranks_start_their_own_processes_the_way_the_launcher_would(tmp_path: Path) -> None:
    """A rank forked from the fork server keeps its launcher's start method (Linux's fork
    unless the program chose another), so its DataLoader workers are forked, not started
    through a fork server of its own that imports the program again for every worker."""
    script = tmp_path / "start_methods.py"
    script.write_text(_START_METHODS)
    done = subprocess.run(
        [sys.executable, str(script)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["fork fork", "spawn spawn"]
