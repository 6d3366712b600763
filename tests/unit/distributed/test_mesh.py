"""The two-dimensional layout's shape (replicate x shard) and its refusals, without
processes: HSDP's training itself runs in tests/integration/test_hsdp.py."""

from __future__ import annotations

import pytest

from paratrain.distributed.mesh import (
    REPLICATE,
    SHARD,
    STAGE,
    coordinates,
    mesh_names,
    mesh_shape,
    place,
)
from paratrain.runtime.config import RuntimeConfig
from paratrain.strategies import FSDP, Pipeline, build_strategy
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


def test_replicate_reaches_fsdp_and_pipeline_and_is_refused_elsewhere() -> None:
    config = RuntimeConfig.of(strategy="fsdp", devices="cpu,cpu,cpu,cpu", replicate=2)
    assert config.strategy == FSDP() and config.options.replicate == 2
    assert RuntimeConfig.of(strategy=FSDP(blocks=("Block",)), replicate=2).replicate == 2
    assert RuntimeConfig.of(strategy=Pipeline(schedule="gpipe"), replicate=2).replicate == 2
    for name in ("ddp", "cpu"):
        with pytest.raises(UserError) as caught:
            RuntimeConfig.of(strategy=name, replicate=2)
        assert str(caught.value) == (
            f"--replicate applies to --strategy fsdp, pipeline only, not {name}; drop "
            "--replicate or use --strategy fsdp"
        )
    with pytest.raises(UserError, match="--replicate must be at least 1, got 0"):
        RuntimeConfig.of(strategy="fsdp", replicate=0)
    # the processes are known when the strategy is built, before any starts
    uneven = RuntimeConfig.of(strategy="fsdp", devices="cpu,cpu,cpu", replicate=2)
    with pytest.raises(UserError, match="--replicate 2 does not divide the 3 processes"):
        build_strategy(uneven.strategy, uneven.devices, uneven.options)


@pytest.mark.parametrize(
    ("world_size", "replicate", "places"),
    [
        (4, 2, [(0, 0), (0, 1), (1, 0), (1, 1)]),
        (6, 2, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]),
        (6, 3, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]),
        (3, 1, [(0, 0), (0, 1), (0, 2)]),
    ],
)
def test_ranks_fill_the_mesh_row_by_row(
    world_size: int, replicate: int, places: list[tuple[int, int]]
) -> None:
    """rank -> (copy, place in the copy): one copy's processes are consecutive ranks."""
    assert [coordinates(r, world_size, replicate) for r in range(world_size)] == places
    assert mesh_names(mesh_shape(world_size, replicate), inner=STAGE)[-1] == STAGE


def test_a_pipeline_in_copies_splits_the_data_by_copy() -> None:
    """pipeline x4 --replicate 2: two stages per copy, the batch in two parts, and the
    first rank of each copy counts its part's results once."""
    config = RuntimeConfig.of(strategy="pipeline", devices="cpu,cpu,cpu,cpu", replicate=2)
    strategy = build_strategy(config.strategy, config.devices, config.options)
    assert strategy.data_shards == 2 and strategy.data_rank == 0
    assert strategy.data_leaders == [0, 2]
    assert strategy.describe()["mesh"] == {"replicate": 2, "stage": 2}


@pytest.mark.parametrize(
    ("devices", "replicate", "message"),
    [
        (
            4,
            4,
            "--replicate 4 leaves one process per copy of the pipeline, which needs at least 2 "
            "stages; use --strategy ddp, or a --replicate that leaves 2 or more processes per "
            "copy",
        ),
        (3, 2, "--replicate 2 does not divide the 3 processes into equal copies; use one of 1, 3"),
    ],
)
def test_a_pipeline_in_copies_of_fewer_than_two_stages_is_refused(
    devices: int, replicate: int, message: str
) -> None:
    config = RuntimeConfig.of(
        strategy="pipeline", devices=",".join(["cpu"] * devices), replicate=replicate
    )
    with pytest.raises(UserError) as caught:
        build_strategy(config.strategy, config.devices, config.options)
    assert str(caught.value) == message


def test_a_process_is_named_by_its_coordinates_in_a_two_dimensional_layout() -> None:
    """What a hang report says of a rank: its coordinates by the dimensions' names."""
    assert [place(r, 4, replicate=2) for r in range(4)] == [
        "replicate 0, shard 0",
        "replicate 0, shard 1",
        "replicate 1, shard 0",
        "replicate 1, shard 1",
    ]
    assert place(5, 6, replicate=2, inner=STAGE) == "replicate 1, stage 2"
    assert place(3, 4, tp=2) == "shard 1, tp 1"
    assert place(1, 2) == ""  # one dimension: the rank says it all
    fsdp = RuntimeConfig.of(strategy="fsdp", devices="cpu,cpu,cpu,cpu", replicate=2)
    assert build_strategy(fsdp.strategy, fsdp.devices, fsdp.options).place == "replicate 0, shard 0"
