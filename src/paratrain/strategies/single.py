"""Shared logic of the strategies that train on exactly one device in one process."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from paratrain.devices.machine import parse_count, parse_device_list
from paratrain.strategies.base import Strategy
from paratrain.utils.errors import UserError


class SingleDeviceStrategy(Strategy):
    device_type: ClassVar[str]

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device(cls.device_type)

    @classmethod
    def resolve_devices(cls, spec: str | None) -> list[torch.device]:
        reason = cls.unavailable_reason()
        if reason is not None:
            raise UserError(f"--strategy {cls.name}: {reason}; use --strategy auto or cpu")
        count = parse_count(spec)
        if spec is None or count == 1:
            return [cls.default_device()]
        if count is not None:
            raise UserError(
                f"--strategy {cls.name} trains on one device, not {count}; "
                "use --strategy ddp (or dp, dp-balanced) for several"
            )
        devices = parse_device_list(str(spec))
        if len(devices) != 1 or devices[0].type != cls.device_type:
            raise UserError(
                f"--strategy {cls.name} takes one {cls.device_type} device, got --devices {spec}"
            )
        cls.check_device(devices[0])
        return devices

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        """Raise ``UserError`` if ``device`` does not exist here."""

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model
