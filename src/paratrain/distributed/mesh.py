"""The processes of a run laid out in two dimensions: ``replicate`` copies of a layout, each
over ``world_size // replicate`` processes (the layout's own dimension: ``shard`` for fsdp,
``stage`` for a pipeline); or ``world_size // tp`` shards (``shard``), each a group of ``tp``
processes that split every layer's width between them (tensor parallel, ``tp``).

Ranks fill the mesh row by row, so the processes of one copy are consecutive ranks: under
torchrun one copy sits on one machine and only the replicas' traffic crosses machines. The
``tp`` processes of a group are consecutive too: tensor parallelism moves activations at
every layer, so its group belongs inside a machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.utils.errors import UserError

if TYPE_CHECKING:  # torch.distributed.device_mesh loads DTensor: imported when a mesh is built
    from torch.distributed.device_mesh import DeviceMesh

#: the names of the mesh's dimensions, outer first
REPLICATE, SHARD, TP = "replicate", "shard", "tp"
#: a pipeline's own dimension: its stages
STAGE = "stage"


def mesh_shape(world_size: int, replicate: int = 1, tp: int = 1) -> tuple[int, ...]:
    """``(world_size,)`` for one copy, ``(replicate, world_size // replicate)`` for copies,
    ``(world_size // tp, tp)`` under tensor parallelism; ``UserError`` where ``replicate`` or
    ``tp`` does not divide the processes, or both are given."""
    if replicate < 1:
        raise UserError(f"--replicate must be at least 1, got {replicate}")
    if tp < 1:
        raise UserError(f"--tp must be at least 1, got {tp}")
    if tp > 1:
        return _tp_shape(world_size, replicate, tp)
    if world_size % replicate:
        fitting = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0)
        raise UserError(
            f"--replicate {replicate} does not divide the {world_size} processes into equal "
            f"copies; use one of {fitting}"
        )
    if replicate == 1:
        return (world_size,)
    return (replicate, world_size // replicate)


def _tp_shape(world_size: int, replicate: int, tp: int) -> tuple[int, int]:
    if replicate > 1:
        raise UserError("--tp with --replicate is not built yet; drop one of them")
    if world_size % tp:
        fitting = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0)
        raise UserError(
            f"--tp {tp} does not divide the {world_size} processes into equal groups; use one "
            f"of {fitting}"
        )
    return (world_size // tp, tp)


def mesh_names(shape: tuple[int, ...], tp: int = 1, inner: str = SHARD) -> tuple[str, ...]:
    """The dimension names of a mesh of ``shape`` (:func:`mesh_shape`'s, with its ``tp``);
    ``inner``: the layout's own dimension."""
    if len(shape) == 1:
        return (inner,)
    return (SHARD, TP) if tp > 1 else (REPLICATE, inner)


def coordinates(rank: int, world_size: int, replicate: int = 1) -> tuple[int, int]:
    """``rank``'s place in the mesh: (its copy, its index inside the copy)."""
    copy, index = divmod(rank, mesh_shape(world_size, replicate)[-1])
    return copy, index


def place(rank: int, world_size: int, replicate: int = 1, tp: int = 1, inner: str = SHARD) -> str:
    """``rank``'s coordinates in the mesh by name (``"replicate 1, shard 0"``), for reports
    that name a process; ``""`` where the run has one dimension."""
    shape = mesh_shape(world_size, replicate, tp)
    if len(shape) == 1:
        return ""
    outer, index = divmod(rank, shape[-1])
    names = mesh_names(shape, tp, inner)
    return f"{names[0]} {outer}, {names[1]} {index}"


def device_mesh(
    device_type: str, world_size: int, replicate: int = 1, tp: int = 1, inner: str = SHARD
) -> DeviceMesh:
    """The ``DeviceMesh`` of every process of the run (a collective: all call it)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(world_size, replicate, tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=mesh_names(shape, tp, inner))
