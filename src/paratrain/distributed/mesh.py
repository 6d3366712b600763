"""The processes of a run laid out in two dimensions: ``replicate`` copies of a layout, each
over ``world_size // replicate`` processes (the layout's own dimension: ``shard`` for fsdp,
``stage`` for a pipeline).

Ranks fill the mesh row by row, so the processes of one copy are consecutive ranks: under
torchrun one copy sits on one machine and only the replicas' traffic crosses machines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.utils.errors import UserError

if TYPE_CHECKING:  # torch.distributed.device_mesh loads DTensor: imported when a mesh is built
    from torch.distributed.device_mesh import DeviceMesh

#: the names of the mesh's dimensions, outer first
REPLICATE, SHARD = "replicate", "shard"
#: a pipeline's own dimension: its stages
STAGE = "stage"


def mesh_shape(world_size: int, replicate: int = 1) -> tuple[int, ...]:
    """``(world_size,)`` for one copy, else ``(replicate, world_size // replicate)``;
    ``UserError`` where ``replicate`` does not divide the processes."""
    if replicate < 1:
        raise UserError(f"--replicate must be at least 1, got {replicate}")
    if world_size % replicate:
        fitting = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0)
        raise UserError(
            f"--replicate {replicate} does not divide the {world_size} processes into equal "
            f"copies; use one of {fitting}"
        )
    if replicate == 1:
        return (world_size,)
    return (replicate, world_size // replicate)


def mesh_names(shape: tuple[int, ...], inner: str = SHARD) -> tuple[str, ...]:
    """The dimension names of a mesh of ``shape`` (:func:`mesh_shape`'s); ``inner``: the
    layout's own dimension."""
    return (inner,) if len(shape) == 1 else (REPLICATE, inner)


def coordinates(rank: int, world_size: int, replicate: int = 1) -> tuple[int, int]:
    """``rank``'s place in the mesh: (its copy, its index inside the copy)."""
    copy, index = divmod(rank, mesh_shape(world_size, replicate)[-1])
    return copy, index


def device_mesh(
    device_type: str, world_size: int, replicate: int = 1, inner: str = SHARD
) -> DeviceMesh:
    """The ``DeviceMesh`` of every process of the run (a collective: all call it)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(world_size, replicate)
    return init_device_mesh(device_type, shape, mesh_dim_names=mesh_names(shape, inner))
