"""Fault injection points (paratrain.utils.injection): inert without a plug-in, whatever the
environment says; the suite's plug-in (tests/plugins) reaches every process through its entry
point; and no test hook is read from a variable in src/."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import paratrain_test_faults
import pytest
from conftest import PLUGINS, REPO, subprocess_env

from paratrain.utils import injection


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _without_plugins(**extra: str) -> dict[str, str]:
    """The test's environment for a child process, the suite's plug-in off its path."""
    env = subprocess_env(**extra)
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p and Path(p) != PLUGINS)
    return env


def test_no_test_hook_is_read_from_a_variable_in_src() -> None:
    files = [p for p in (REPO / "src").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted(files)
        for number, line in enumerate(path.read_bytes().splitlines(), 1)
        if b"PARATRAIN_TEST_" in line
    ]
    assert found == []


def test_without_a_plugin_the_points_are_inert_whatever_the_environment_says() -> None:
    """No plug-in: each point hands back what it was given, and a real step under
    ``--oom auto`` with every old test variable set is a plain step (no NaN, no halving)."""
    loud = {
        "PARATRAIN_TEST_FAULT": "nan:0:1",
        "PARATRAIN_TEST_OOM": "*:0",
        "PARATRAIN_TEST_COMPILE_FAULT": "zero-grads",
        "PARATRAIN_TEST_BUSY_CORES": "7",
    }
    code = """
        import math
        from importlib.metadata import entry_points

        import torch
        from torch import nn

        import paratrain
        from paratrain.utils import injection

        assert not list(entry_points(group=injection.GROUP))
        loss, grads = object(), [torch.ones(2)]
        assert injection.at_step(0, 1, loss) is loss
        assert injection.oom(0, 10**6, 1) is None
        assert injection.compiled_grads(grads) is grads
        assert injection.checkpoint_written(__import__("pathlib").Path(".")) is None
        assert injection.busy_cores() is None
        assert injection.handlers() == {}

        rt = paratrain.Runtime(strategy="cpu", oom="auto")
        model = nn.Linear(4, 2)
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        loss = rt.forward_backward(model, nn.functional.cross_entropy, x, y)
        optimizer.step()
        assert math.isfinite(loss.item()) and rt.micro_batches.split == 1
        print("inert")
    """
    done = _run(code, _without_plugins(**loud))
    assert done.returncode == 0 and done.stdout.strip() == "inert", done.stderr[-3000:]


def test_the_suites_plugin_is_loaded_in_a_process_it_starts() -> None:
    code = """
        import torch

        from paratrain.utils import injection

        table = injection.handlers()
        assert sorted(table) == sorted(injection.POINTS), table
        assert all(h.__module__ == "paratrain_test_faults" for h in table.values())
        assert injection.busy_cores() == 3.0
        assert torch.isnan(injection.at_step(1, 2, torch.ones(()))).item()
        print("loaded")
    """
    env = subprocess_env(PARATRAIN_TEST_BUSY_CORES="3", PARATRAIN_TEST_FAULT="nan:1:2")
    done = _run(code, env)
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr[-3000:]


def test_a_registered_handler_wins_and_is_put_back() -> None:
    assert injection.handlers()["oom"] is paratrain_test_faults.oom  # this process too
    seen: list[tuple[int, int, int]] = []
    with injection.injected("oom", lambda *args: seen.append(args)):
        injection.oom(1, 64, 3)
    assert seen == [(1, 64, 3)]
    assert injection.handlers()["oom"] is paratrain_test_faults.oom
    with pytest.raises(ValueError, match="no fault injection point 'oops': use one of at_step"):
        injection.register("oops", print)


def test_a_broken_plugin_names_itself(tmp_path: Path) -> None:
    info = tmp_path / "broken_plugin-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[paratrain.plugins]\nbroken = broken_plugin:go\n")
    (tmp_path / "broken_plugin.py").write_text("def go():\n    raise OSError('no disk')\n")
    env = _without_plugins()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    done = _run("from paratrain.utils import injection; injection.oom(0, 1, 1)", env)
    assert done.returncode == 1
    assert "paratrain plug-in broken = broken_plugin:go: no disk" in done.stderr
