"""What a :class:`~paratrain.Runtime` is built from: everything needed to rebuild the same
runtime in another process (``paratrain.Runtime.from_config``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paratrain.devices.precision import normalize_precision
from paratrain.runtime.batching import check_batch_size_per
from paratrain.runtime.oom import check_oom_mode
from paratrain.runtime.speed import SpeedOptions
from paratrain.strategies import StrategyOptions, strategy_names
from paratrain.utils.errors import UserError

#: defaults for ``strategy="auto"`` and ``devices=None``, set by `paratrain run`
STRATEGY_VARIABLE = "PARATRAIN_STRATEGY"
DEVICES_VARIABLE = "PARATRAIN_DEVICES"


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything needed to rebuild the same runtime in another process."""

    strategy: str = "auto"
    devices: str | None = None
    precision: str = "32"
    #: None: the random generators are left as the script set them (see paratrain.runtime.seeding)
    seed: int | None = None
    accumulate: int = 1
    sync_batchnorm: bool = False
    deterministic: bool = False
    speed: SpeedOptions = field(default_factory=SpeedOptions)
    #: "global" (default) or "process": what a loader's batch_size means
    #: (paratrain.runtime.batching)
    batch_size_per: str = "global"
    #: what only some strategies read (fsdp's blocks)
    options: StrategyOptions = field(default_factory=StrategyOptions)
    #: intra-op threads of each process; None: chosen (paratrain.launching.threads)
    threads: int | None = None
    #: "auto": a micro-batch that runs out of memory is redone in smaller pieces
    #: (paratrain.runtime.oom)
    oom: str = "off"
    #: each block's activations recomputed in the backward
    #: (paratrain.runtime.activation_checkpointing)
    activation_checkpointing: bool = False

    @classmethod
    def of(
        cls,
        strategy: str,
        devices: str | int | None,
        precision: str,
        seed: int | None,
        accumulate: int,
        sync_batchnorm: bool,
        deterministic: bool,
        compile: bool | str | None,
        channels_last: bool | None,
        fused_optimizer: bool | None,
        batch_size_per: str,
        fsdp_blocks: Sequence[str],
        pipeline_split: Sequence[str],
        pipeline_schedule: str,
        pipeline_microbatches: int,
        threads: int | None,
        oom: str,
        activation_checkpointing: bool,
    ) -> RuntimeConfig:
        """The configuration of ``Runtime(...)``'s arguments, validated; ``strategy="auto"``
        and ``devices=None`` take `paratrain run`'s choice from the environment."""
        if strategy == "auto":
            strategy = os.environ.get(STRATEGY_VARIABLE) or strategy
        if devices is None:
            devices = os.environ.get(DEVICES_VARIABLE) or None
        spec = None if devices is None else str(devices)
        precision = normalize_precision(precision)
        options = StrategyOptions(
            precision,
            tuple(fsdp_blocks),
            tuple(pipeline_split),
            pipeline_schedule,
            pipeline_microbatches,
        )
        speed = SpeedOptions.of(compile, channels_last, fused_optimizer)
        return cls(
            strategy,
            spec,
            precision,
            seed,
            accumulate,
            sync_batchnorm,
            deterministic,
            speed,
            batch_size_per,
            options,
            threads,
            oom,
            activation_checkpointing,
        ).validate()

    def validate(self) -> RuntimeConfig:
        if self.threads is not None and self.threads < 1:
            raise UserError(f"threads must be at least 1, got {self.threads}")
        normalize_precision(self.precision)
        check_oom_mode(self.oom)
        check_batch_size_per(self.batch_size_per)
        if self.accumulate < 1:
            raise UserError(f"accumulate must be at least 1, got {self.accumulate}")
        if self.strategy not in strategy_names():
            valid = ", ".join(strategy_names())
            raise UserError(f"unknown strategy {self.strategy!r}; valid strategies: {valid}")
        return self

    def runtime_arguments(self) -> dict[str, Any]:
        """The keyword arguments of ``Runtime(...)`` that build this configuration."""
        return {
            "strategy": self.strategy,
            "devices": self.devices,
            "precision": self.precision,
            "seed": self.seed,
            "accumulate": self.accumulate,
            "sync_batchnorm": self.sync_batchnorm,
            "deterministic": self.deterministic,
            "compile": self.speed.compile,
            "channels_last": self.speed.channels_last,
            "fused_optimizer": self.speed.fused_optimizer,
            "batch_size_per": self.batch_size_per,
            "fsdp_blocks": self.options.fsdp_blocks,
            "pipeline_split": self.options.pipeline_split,
            "pipeline_schedule": self.options.pipeline_schedule,
            "pipeline_microbatches": self.options.pipeline_microbatches,
            "threads": self.threads,
            "oom": self.oom,
            "activation_checkpointing": self.activation_checkpointing,
        }
