"""``collective_check=False`` (``--no-collective-check``) turns the collective-order check
off: no background thread compares the processes' collectives. Devices: `ddp` on
`cpu,cpu` under rt.launch."""

from __future__ import annotations

import pytest

import paratrain
from paratrain.cli.commands.train import config_from_args
from paratrain.cli.main import build_parser
from paratrain.distributed import collective_order

pytestmark = pytest.mark.slow  # real processes, or several layers at work


def _checking(rt: paratrain.Runtime) -> bool:
    rt.barrier()  # joins the process group, where the check starts
    return collective_order._check is not None


def test_the_collective_check_is_on_by_default_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(collective_order.CHECK_VARIABLE, raising=False)
    assert paratrain.RuntimeConfig().collective_check
    on = paratrain.Runtime(strategy="ddp", devices="cpu,cpu")
    off = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", collective_check=False)
    assert (on.launch(_checking), off.launch(_checking)) == (True, False)


def test_train_has_no_collective_check_from_the_declaration() -> None:
    args = build_parser().parse_args(["train", "--strategy", "cpu", "--no-collective-check"])
    assert config_from_args(args).runtime_config().collective_check is False
    args = build_parser().parse_args(["train", "--strategy", "cpu"])
    assert config_from_args(args).runtime_config().collective_check is True
