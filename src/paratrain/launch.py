"""How processes start. A strategy says how many it needs; this module starts them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from paratrain.runtime import Runtime

T = TypeVar("T")


def launch(runtime: Runtime, fn: Callable[..., T], *args: Any) -> T | None:
    """Run ``fn(runtime, *args)`` in every process the runtime's strategy needs."""
    runtime._connect()
    return fn(runtime, *args)
