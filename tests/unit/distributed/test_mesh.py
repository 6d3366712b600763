"""The two-dimensional layout's shape (replicate x shard) and its refusals, without
processes: HSDP's training itself runs in tests/integration/test_hsdp.py."""

from __future__ import annotations

import pytest

from paratrain.distributed.mesh import REPLICATE, SHARD, mesh_names, mesh_shape
from paratrain.runtime.config import RuntimeConfig
from paratrain.strategies import FSDP, build_strategy
from paratrain.utils.errors import UserError


@pytest.mark.parametrize(
    ("world_size", "replicate", "shape"),
    [(4, 1, (4,)), (4, 2, (2, 2)), (8, 2, (2, 4)), (6, 3, (3, 2)), (4, 4, (4, 1)), (1, 1, (1,))],
)
def test_replicas_are_the_outer_dimension(
    world_size: int, replicate: int, shape: tuple[int, ...]
) -> None:
    assert mesh_shape(world_size, replicate) == shape
    names = mesh_names(shape)
    assert names == ((SHARD,) if replicate == 1 else (REPLICATE, SHARD))


@pytest.mark.parametrize(
    ("world_size", "replicate", "message"),
    [
        (
            4,
            3,
            "--replicate 3 does not divide the 4 processes into equal copies; use one of 1, 2, 4",
        ),
        (2, 4, "--replicate 4 does not divide the 2 processes into equal copies; use one of 1, 2"),
        (4, 0, "--replicate must be at least 1, got 0"),
    ],
)
def test_a_replicate_that_does_not_divide_is_refused(
    world_size: int, replicate: int, message: str
) -> None:
    with pytest.raises(UserError) as caught:
        mesh_shape(world_size, replicate)
    assert str(caught.value) == message


def test_replicate_reaches_fsdp_and_is_refused_elsewhere() -> None:
    config = RuntimeConfig.of(strategy="fsdp", devices="cpu,cpu,cpu,cpu", replicate=2)
    assert config.strategy == FSDP() and config.options.replicate == 2
    assert RuntimeConfig.of(strategy=FSDP(blocks=("Block",)), replicate=2).replicate == 2
    for name in ("ddp", "cpu", "pipeline"):
        with pytest.raises(UserError) as caught:
            RuntimeConfig.of(strategy=name, replicate=2)
        assert str(caught.value) == (
            f"--replicate applies to --strategy fsdp only, not {name}; drop --replicate or "
            "use --strategy fsdp"
        )
    with pytest.raises(UserError, match="--replicate must be at least 1, got 0"):
        RuntimeConfig.of(strategy="fsdp", replicate=0)
    # the processes are known when the strategy is built, before any starts
    uneven = RuntimeConfig.of(strategy="fsdp", devices="cpu,cpu,cpu", replicate=2)
    with pytest.raises(UserError, match="--replicate 2 does not divide the 3 processes"):
        build_strategy(uneven.strategy, uneven.devices, uneven.options)
