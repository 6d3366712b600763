"""fsdp x tensor parallel's mesh (shard x tp) and its refusals, without processes: the
training itself runs in tests/integration/test_fsdp_tp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli import main_in_process
from torch import nn

from paratrain.distributed.mesh import SHARD, TP, mesh_names, mesh_shape
from paratrain.models import GPT
from paratrain.runtime.config import RuntimeConfig
from paratrain.strategies.tensor_parallel import check_tp_model
from paratrain.utils.errors import UserError


@pytest.mark.parametrize(
    ("world_size", "tp", "shape"), [(4, 2, (2, 2)), (8, 2, (4, 2)), (8, 4, (2, 4)), (4, 4, (1, 4))]
)
def test_tp_groups_are_the_inner_dimension(
    world_size: int, tp: int, shape: tuple[int, ...]
) -> None:
    assert mesh_shape(world_size, tp=tp) == shape
    assert mesh_names(shape, tp) == (SHARD, TP)


@pytest.mark.parametrize(
    ("world_size", "replicate", "tp", "message"),
    [
        (4, 1, 3, "--tp 3 does not divide the 4 processes into equal groups; use one of 1, 2, 4"),
        (4, 1, 0, "--tp must be at least 1, got 0"),
        (4, 2, 2, "--tp with --replicate is not built yet; drop one of them"),
    ],
)
def test_a_tp_that_does_not_fit_is_refused(
    world_size: int, replicate: int, tp: int, message: str
) -> None:
    with pytest.raises(UserError) as caught:
        mesh_shape(world_size, replicate, tp)
    assert str(caught.value) == message


def test_tp_reaches_fsdp_and_is_refused_elsewhere() -> None:
    config = RuntimeConfig.of(strategy="fsdp", devices="cpu,cpu,cpu,cpu", tp=2)
    assert config.options.tp == 2
    for name in ("ddp", "cpu", "pipeline"):
        with pytest.raises(UserError) as caught:
            RuntimeConfig.of(strategy=name, tp=2)
        assert str(caught.value) == (
            f"--tp applies to --strategy fsdp only, not {name}; drop --tp or use --strategy fsdp"
        )


def test_only_the_built_in_gpt_with_heads_that_split_is_taken() -> None:
    check_tp_model(GPT(width=64, heads=4), tp=2, shards=2)
    with pytest.raises(UserError) as caught:
        check_tp_model(nn.Sequential(nn.Linear(4, 4)), tp=2, shards=2)
    assert str(caught.value) == (
        "--tp has a plan for paratrain's built-in GPT (paratrain.models.gpt.GPT, --recipe "
        "tiny-gpt) only, not Sequential; drop --tp"
    )
    with pytest.raises(UserError, match="--tp 8 does not divide the GPT's 4 attention heads"):
        check_tp_model(GPT(width=64, heads=4), tp=8, shards=1)
    with pytest.raises(UserError, match="leaves 3 fsdp shards, which do not divide the GPT's"):
        check_tp_model(GPT(width=64, heads=4), tp=2, shards=3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ("--recipe", "digits", "--strategy", "fsdp", "--devices", "cpu,cpu,cpu,cpu"),
            "--tp has a plan for paratrain's built-in GPT",
        ),
        (
            ("--recipe", "tiny-gpt", "--strategy", "ddp", "--devices", "cpu,cpu"),
            "--tp applies to --strategy fsdp only, not ddp",
        ),
    ],
)
def test_bad_tp_is_one_line_and_exit_2_before_any_process(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, options: tuple[str, ...], message: str
) -> None:
    out = tmp_path / "bad"
    code, _, err = main_in_process(capfd, "train", *options, "--tp", 2, "--out", out)
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()
