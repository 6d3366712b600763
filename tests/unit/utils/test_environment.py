"""The process's environment, parsed in one place (paratrain.utils.environment).
Devices: none."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.utils import environment
from paratrain.utils.environment import Environment


def test_a_launched_rank_under_torchrun() -> None:
    env = Environment(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "PARATRAIN_REPORT_DIR": "/tmp/reports",
        }
    )
    assert env.launched and env.rank == 3 and not env.is_rank_zero
    assert (env.local_rank, env.world_size, env.local_world_size) == (1, 4, 2)
    assert (env.master_addr, env.master_port, env.attempt) == ("127.0.0.1", 29500, 2)
    assert env.agent_store and env.report_dir == Path("/tmp/reports")
    assert env.heartbeat_dir is None and env.parent_pid is None


def test_one_process_started_by_hand() -> None:
    env = Environment({"RANK": "", "PET_NPROC_PER_NODE": "4"})
    assert not env.launched and env.rank == 0 and env.is_rank_zero and env.has_rank
    assert env.world_size == 1 and env.local_world_size is None and env.attempt == 0


def test_a_kubeflow_pod_without_torchrun_says_its_processes_per_pod() -> None:
    launched = {"RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    assert Environment({**launched, "PET_NPROC_PER_NODE": "4"}).local_world_size == 4
    assert Environment(launched).local_world_size == 8


def test_the_snapshot_follows_a_change_of_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "1")
    first = environment.current()
    assert first.rank == 1 and environment.current() is first  # parsed once
    monkeypatch.setenv("RANK", "2")
    assert environment.current().rank == 2
