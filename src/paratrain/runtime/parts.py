"""The parts a :class:`~paratrain.Runtime` is made of, built from its configuration in
the order that matters: the strategy, then this process's threads (before torch's thread
pools start), then the speed options and precision. They exist once, in
:class:`RuntimeParts`: the facade's properties read and replace them there, and the groups
of methods it delegates to read them there each time they are called (so that a part a user
or test replaces on the runtime is the one they use)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from paratrain.devices.precision import Precision
from paratrain.launching.launch import launched
from paratrain.launching.threads import ThreadChoice, apply_here, choose_for
from paratrain.runtime.config import RuntimeConfig
from paratrain.runtime.determinism import numerics_settings
from paratrain.runtime.nonfinite import NonFiniteCheck
from paratrain.runtime.oom import MicroBatches
from paratrain.runtime.speed import Speed
from paratrain.runtime.step_state import StepState
from paratrain.strategies import Strategy, build_strategy, check_sync_batchnorm
from paratrain.utils import environment
from paratrain.utils.errors import UserError


@dataclass
class RuntimeParts:
    """One runtime's configuration and the parts built from it."""

    config: RuntimeConfig
    strategy: Strategy
    #: this process's intra-op threads, and those of the processes it starts
    threads: ThreadChoice
    speed: Speed
    precision: Precision
    #: where training stands (paratrain.runtime.step_state): the step pipeline advances it
    state: StepState
    #: the policy for non-finite losses (the nonfinite option, --skip-nonfinite)
    nonfinite: NonFiniteCheck
    #: --oom auto: how many pieces each micro-batch is cut into
    micro_batches: MicroBatches
    #: why --oom auto cannot work under this strategy (said once, at rt.setup), or None
    oom_refused: str | None
    #: what a model built on the meta device is initialised from (rt.setup's init_seed)
    init_seed: int | None


def assemble(config: RuntimeConfig) -> RuntimeParts:
    """Build the parts of a runtime; refuses settings the strategy cannot apply."""
    strategy = build_strategy(config.strategy, config.devices, config.options)
    threads = choose_for(strategy.num_processes, config.threads, not config.deterministic)
    if strategy.num_processes == 1 or launched():  # before torch's pools start
        apply_here(threads)
        # what this process has: OpenMP read the wait policy when torch was imported
        policy = environment.current().get("OMP_WAIT_POLICY") or "default"
        threads = dataclasses.replace(threads, wait_policy=policy)
    check_sync_batchnorm(strategy, config.sync_batchnorm)
    if config.activation_checkpointing and not strategy.allows_activation_checkpointing:
        raise UserError(
            "--activation-checkpointing does not work with --strategy "
            f"{strategy.name}: its replicas of the model run the blocks' original "
            "forward; use ddp or fsdp"
        )
    oom_refused = strategy.oom_refused() if config.oom == "auto" else None
    return RuntimeParts(
        config=config,
        strategy=strategy,
        threads=threads,
        speed=Speed(config.speed, strategy),
        precision=Precision(config.precision, strategy.root_device),
        state=StepState(config.accumulate, config.agreement_seconds),
        nonfinite=NonFiniteCheck(config.nonfinite),
        micro_batches=MicroBatches("off" if oom_refused else config.oom),
        oom_refused=oom_refused,
        init_seed=config.seed,
    )


def describe(rt: RuntimeParts) -> dict[str, Any]:
    """What ``rt.describe()`` reports: the strategy and every setting in force."""
    return {
        **rt.strategy.describe(),
        "precision": rt.precision.name,
        "world_size": rt.strategy.collective.world_size,
        "accumulate": rt.state.accumulate,
        "deterministic": rt.config.deterministic,
        **rt.micro_batches.describe(),
        "activation_checkpointing": rt.config.activation_checkpointing,
        "numerics": numerics_settings(),
        "threads": rt.threads.describe(),
        **rt.speed.describe(),
    }
