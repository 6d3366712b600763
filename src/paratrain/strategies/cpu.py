"""Train on the CPU in one process."""

from __future__ import annotations

from paratrain.catalog import STRATEGIES
from paratrain.strategies.registry import register
from paratrain.strategies.single import SingleDeviceStrategy


@register
class CPUStrategy(SingleDeviceStrategy):
    name = "cpu"
    description = STRATEGIES["cpu"]
    device_type = "cpu"
