"""Strategies, one module each, registered by name on import; and the choices a
configuration names them with (:mod:`.choices`: ``FSDP(blocks=...)``, ``Pipeline(...)``)."""

from __future__ import annotations

from typing import Any

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
from paratrain.strategies.choices import (
    CPU,
    CUDA,
    DDP,
    DP,
    FLAT_OWNERS,
    FSDP,
    MPS,
    Auto,
    DPBalanced,
    Pipeline,
    StrategyChoice,
    check_replicate,
    check_tp,
    choose,
    flat_default,
)
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
    "CPU",
    "CUDA",
    "DDP",
    "DP",
    "FSDP",
    "MPS",
    "Auto",
    "Collective",
    "DPBalanced",
    "Pipeline",
    "Strategy",
    "StrategyChoice",
    "StrategyOptions",
    "build_strategy",
    "check_replicate",
    "check_sync_batchnorm",
    "check_tp",
    "choose",
    "count_processes",
    "describe_strategies",
    "options_for",
    "register",
    "resolve_auto",
    "resolved_name",
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


def options_for(choice: StrategyChoice, precision: str = "32", **run: Any) -> StrategyOptions:
    """What the strategy ``choice`` stands for is built with; ``run``: the run's settings
    strategies apply (``StrategyOptions``' other fields)."""
    flat = {name: flat_default(name) for name in FLAT_OWNERS}
    return StrategyOptions(precision, **{**flat, **choice.flat_options()}, **run)


def _class_and_devices(
    strategy: str | StrategyChoice, devices: str | int | None
) -> tuple[type[Strategy], list[torch.device]]:
    spec = None if devices is None else str(devices)
    name = strategy if isinstance(strategy, str) else strategy.name
    if name == AUTO:
        name = resolve_auto(spec)
    cls = strategy_class(name)
    return cls, cls.resolve_devices(spec)


def resolved_name(strategy: str | StrategyChoice, devices: str | int | None) -> str:
    """The name of the strategy ``strategy`` runs on ``devices`` (``auto`` resolved)."""
    return _class_and_devices(strategy, devices)[0].name


def count_processes(strategy: str | StrategyChoice, devices: str | int | None) -> int:
    """How many processes ``strategy`` on ``devices`` starts, without building it; refuses
    an unknown strategy or bad devices (``UserError``)."""
    cls, resolved = _class_and_devices(strategy, devices)
    return cls.count_processes(resolved)


def build_strategy(
    strategy: str | StrategyChoice,
    devices: str | int | None,
    options: StrategyOptions | None = None,
) -> Strategy:
    """Validate ``strategy``, ``devices`` and ``options`` and build the strategy (no process
    group yet); a choice with options brings them unless ``options`` is given."""
    cls, resolved = _class_and_devices(strategy, devices)
    if options is None and isinstance(strategy, StrategyChoice):
        options = options_for(strategy)
    return cls(resolved, options)
