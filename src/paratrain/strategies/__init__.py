"""Strategies, one module each, registered by name on import."""

from __future__ import annotations

import torch

from paratrain.devices.machine import cuda_count, mps_available, parse_count, parse_device_list
from paratrain.strategies import (  # noqa: F401  (registration)
    cpu,
    cuda,
    ddp,
    dp,
    dp_balanced,
    fsdp,
    mps,
    pipeline,
)
from paratrain.strategies.base import Collective, Strategy, StrategyOptions
from paratrain.strategies.distributed import launched
from paratrain.strategies.registry import (
    AUTO,
    describe_strategies,
    register,
    strategy_class,
    strategy_names,
)
from paratrain.utils.errors import UserError

__all__ = [
    "AUTO",
    "Collective",
    "Strategy",
    "StrategyOptions",
    "build_strategy",
    "check_sync_batchnorm",
    "describe_strategies",
    "register",
    "resolve_auto",
    "strategy_class",
    "strategy_names",
]


def resolve_auto(devices: str | None) -> str:
    """The strategy ``auto`` stands for: ddp in a process torchrun started, ddp over the GPUs
    where there are two or more (unless ``devices`` names one), else cuda, mps, cpu."""
    if launched():
        return "ddp"
    if cuda_count() >= 2 and _device_count(devices) != 1:
        return "ddp"
    if cuda_count() > 0:
        return "cuda"
    if mps_available():
        return "mps"
    return "cpu"


def _device_count(spec: str | None) -> int | None:
    if spec is None:
        return None
    count = parse_count(spec)
    return count if count is not None else len(parse_device_list(spec))


def check_sync_batchnorm(strategy: Strategy, sync_batchnorm: bool) -> None:
    """SyncBatchNorm elsewhere than across processes would silently be plain BatchNorm."""
    if sync_batchnorm and not strategy.syncs_batchnorm:
        raise UserError(
            f"--sync-batchnorm synchronizes BatchNorm across processes, which strategy "
            f"{strategy.name} does not have; use --strategy ddp or drop --sync-batchnorm"
        )


def build_strategy(
    name: str, devices: str | int | None, options: StrategyOptions | None = None
) -> Strategy:
    """Validate ``name``, ``devices`` and ``options`` and build the strategy (no process
    group yet)."""
    spec = None if devices is None else str(devices)
    if name == AUTO:
        name = resolve_auto(spec)
    cls = strategy_class(name)
    resolved: list[torch.device] = cls.resolve_devices(spec)
    return cls(resolved, options)
