"""Train on Apple's Metal GPU (MPS) in one process."""

from __future__ import annotations

from paratrain.devices.machine import mps_available
from paratrain.strategies.registry import register
from paratrain.strategies.single import SingleDeviceStrategy
from paratrain.utils.catalog import STRATEGIES


@register
class MPSStrategy(SingleDeviceStrategy):
    name = "mps"
    description = STRATEGIES["mps"]
    device_type = "mps"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if mps_available() else "this machine has no Apple MPS device"
