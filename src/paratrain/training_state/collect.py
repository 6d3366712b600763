"""Per-process state brought to the main process, which alone writes checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paratrain.runtime import Runtime


def gather_to_main(rt: Runtime, obj: Any) -> list[Any] | None:
    """Every process's ``obj`` (picklable, small), in rank order, on the main process;
    None on the others. Every process must call it."""
    gathered = [
        rt.broadcast_object(obj if rank == rt.rank else None, src=rank)
        for rank in range(rt.world_size)
    ]
    return gathered if rt.is_main else None
