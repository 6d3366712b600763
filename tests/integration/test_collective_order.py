"""Processes that disagree about the next collective stop in seconds with one message.

Devices: `ddp` on `cpu,cpu` under `paratrain run`; the message itself is checked in this
process. The guarded `rt.save` under rt.launch is tests/test_porting.py's ddp run.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import subprocess_env
from helpers.cli import run_paratrain

from paratrain.distributed.collective_order import (
    CHECK_VARIABLE,
    END_OF_RUN,
    Ledger,
    Position,
    check_seconds,
    disagreement,
)
from paratrain.utils.errors import UserError

pytestmark = pytest.mark.slow  # real processes, or several layers at work

CHECK = "3"  # seconds: the test waits this long, a user 50 by default


def test_the_ledger_numbers_the_outer_collective_only() -> None:
    """No devices: nested collectives (rt.save's gathers) belong to the outer one."""
    ledger = Ledger()
    with ledger.operation("rt.save"), ledger.operation("rt.broadcast_object"):
        assert ledger.position(0).inside == "rt.save"
    assert (ledger.count, ledger.inside, ledger.last) == (1, "", "rt.save")
    position = ledger.position(3)
    assert Position.decode(3, position.encode()) == position


def test_the_message_names_the_operation_and_who_is_in_it() -> None:
    """No devices: a guarded rt.save against a peer that finished."""
    now = time.time() - 60
    waiting = Position(0, 7, "rt.save", now, "rt.backward")
    finished = Position(1, 7, END_OF_RUN, now, "rt.backward")
    message = disagreement([waiting, finished], waiting)
    assert message is not None
    assert "rank 0 has waited 60s in rt.save (collective #7)" in message
    assert "which rank 1 did not reach: rank 1 has finished" in message
    assert "`if rank == 0:`" in message and CHECK_VARIABLE in message
    # seen from the process that finished, the message still names rt.save
    assert disagreement([waiting, finished], finished) == message
    # a peer in the same collective, or not there yet (busy elsewhere): no verdict
    assert disagreement([waiting, Position(1, 7, "rt.save", now, "")], waiting) is None
    assert disagreement([waiting, Position(1, 6, "", now, "rt.backward")], waiting) is None
    training = Position(1, 7, "rt.backward", now, "rt.all_reduce")
    assert "rank 1 is in rt.backward (collective #7)" in str(
        disagreement([waiting, training], waiting)
    )


def test_the_check_time_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_VARIABLE, "0")
    assert check_seconds() is None
    monkeypatch.setenv(CHECK_VARIABLE, "soon")
    with pytest.raises(UserError, match=CHECK_VARIABLE):
        check_seconds()


DDP_CPU = ("--strategy", "ddp", "--devices", "cpu,cpu")
SCRIPT = """
import torch
from torch import nn
import paratrain

rt = paratrain.Runtime()
model = nn.Linear(4, 1)
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(2):
    optimizer.zero_grad()
    rt.backward(model(rt.to_device(torch.randn(4, 4))).sum())
    optimizer.step()
if rt.rank == 0:  # the original's guard kept around a collective
    print(rt.all_reduce(torch.ones(1)))
"""


def test_a_guarded_all_reduce_under_paratrain_run_stops_with_one_message(tmp_path: Path) -> None:
    """ddp on cpu,cpu under `paratrain run` (torchrun's agent): rank 0 in rt.all_reduce,
    rank 1 at the end of the script."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = subprocess_env()
    env[CHECK_VARIABLE] = CHECK
    done = run_paratrain("run", str(script), *DDP_CPU, env=env, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "disagree about the next collective" in done.stderr
    assert "in rt.all_reduce (collective #" in done.stderr and "rank 1 has finished" in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("disagree") == 1
