"""Train on the CPU in one process."""

from __future__ import annotations

from paratrain.strategies.registry import register
from paratrain.strategies.single import SingleDeviceStrategy
from paratrain.utils.catalog import STRATEGIES


@register
class CPUStrategy(SingleDeviceStrategy):
    name = "cpu"
    description = STRATEGIES["cpu"]
    device_type = "cpu"
