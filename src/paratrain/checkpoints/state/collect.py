"""Per-process state brought to the main process, which alone writes checkpoints."""

from __future__ import annotations

from typing import Any

from paratrain.distributed.collective import Collective


def gather_to_main(collective: Collective, obj: Any) -> list[Any] | None:
    """Every process's ``obj`` (picklable, small), in rank order, on the main process;
    None on the others. Every process must call it."""
    gathered = [
        collective.broadcast_object(obj if rank == collective.rank else None, src=rank)
        for rank in range(collective.world_size)
    ]
    return gathered if collective.is_main else None
