"""The facade users put in their own training loop.

    rt = paratrain.Runtime(strategy="auto")
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.setup_loader(loader)
    ...
    rt.backward(loss)

The runtime holds a :class:`~paratrain.strategies.Strategy` and a
:class:`~paratrain.precision.Precision` and delegates to them; it never asks which strategy
it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from paratrain import faults, heartbeat, preemption
from paratrain.activation_checkpointing import apply_activation_checkpointing
from paratrain.batching import check_batch_size_per, global_batch_size
from paratrain.collective import ReduceOp
from paratrain.data_paths import setup_data_path
from paratrain.determinism import make_deterministic, naming_nondeterministic, numerics_settings
from paratrain.errors import PlacementError, UserError
from paratrain.launch import launch, launched
from paratrain.loaders import DeviceLoader
from paratrain.meta_init import MetaInit, is_meta
from paratrain.nonfinite import NonFiniteCheck
from paratrain.oom import MicroBatches, check_oom_mode
from paratrain.oom_step import PieceStep
from paratrain.optim import Accumulation, RuntimeOptimizer, move_optimizer_state
from paratrain.placement import guard_forward, move_to_device
from paratrain.precision import Precision, normalize_precision
from paratrain.seeding import seed_everything
from paratrain.speed import Speed, SpeedOptions
from paratrain.strategies import (
    Strategy,
    StrategyOptions,
    build_strategy,
    check_sync_batchnorm,
    strategy_names,
)
from paratrain.threads import ThreadChoice, apply_here, choose_for
from paratrain.training_state import load_state, save_model_weights, save_state
from paratrain.uneven import join_uneven

T = TypeVar("T")

#: defaults for ``strategy="auto"`` and ``devices=None``, set by `paratrain run`
STRATEGY_VARIABLE = "PARATRAIN_STRATEGY"
DEVICES_VARIABLE = "PARATRAIN_DEVICES"


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything needed to rebuild the same runtime in another process."""

    strategy: str = "auto"
    devices: str | None = None
    precision: str = "32"
    #: None: the random generators are left as the script set them (see paratrain.seeding)
    seed: int | None = None
    accumulate: int = 1
    sync_batchnorm: bool = False
    deterministic: bool = False
    speed: SpeedOptions = field(default_factory=SpeedOptions)
    #: "global" (default) or "process": what a loader's batch_size means (paratrain.batching)
    batch_size_per: str = "global"
    #: what only some strategies read (fsdp's blocks)
    options: StrategyOptions = field(default_factory=StrategyOptions)
    #: intra-op threads of each process; None: chosen (paratrain.threads)
    threads: int | None = None
    #: "auto": a micro-batch that runs out of memory is redone in smaller pieces (paratrain.oom)
    oom: str = "off"
    #: each block's activations recomputed in the backward (paratrain.activation_checkpointing)
    activation_checkpointing: bool = False

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


class Runtime:
    """Places models, optimizers and batches for one strategy; runs the collectives."""

    def __init__(
        self,
        strategy: str = "auto",
        devices: str | int | None = None,
        precision: str = "32",
        seed: int | None = None,
        accumulate: int = 1,
        sync_batchnorm: bool = False,
        deterministic: bool = False,
        compile: bool | str | None = False,
        channels_last: bool | None = None,
        fused_optimizer: bool | None = None,
        batch_size_per: str = "global",
        fsdp_blocks: Sequence[str] = (),
        pipeline_split: Sequence[str] = (),
        pipeline_schedule: str = "1f1b",
        pipeline_microbatches: int = 4,
        threads: int | None = None,
        oom: str = "off",
        activation_checkpointing: bool = False,
    ) -> None:
        """``seed``: None (default) leaves every random generator as the script set it, and
        loaders draw their order from them as torch's DataLoader does; an int seeds Python,
        NumPy and torch with it, and loaders shuffle with their own generator seeded with
        ``seed + epoch`` (see :mod:`paratrain.loaders`).
        ``deterministic``: reproducible on GPUs (see :mod:`paratrain.determinism`);
        ``compile``: True, or a torch.compile mode (see :mod:`paratrain.compiling`);
        ``channels_last`` (None: for a model with Conv2d on CUDA) and ``fused_optimizer``
        (None: SGD/Adam/AdamW on CUDA): see :mod:`paratrain.speed`; ``fsdp_blocks``: class
        names (``"TransformerBlock"``) or module names of the blocks ``strategy="fsdp"``
        shards as one unit each (default: the model's repeated layers); ``pipeline_split``
        (the modules that start stages 2, 3, ...; default: balanced by parameter count),
        ``pipeline_schedule`` ("1f1b" or "gpipe") and ``pipeline_microbatches``: see
        :mod:`paratrain.strategies.pipeline`; ``threads``: intra-op threads of each
        process (default: chosen for the cores and the load, see :mod:`paratrain.threads`);
        ``oom="auto"``: a micro-batch that runs out of memory in ``rt.forward_backward`` is
        redone in smaller pieces, the same step (see :mod:`paratrain.oom`);
        ``activation_checkpointing``: each block recomputes its activations in the backward
        (see :mod:`paratrain.activation_checkpointing`)."""
        if deterministic:  # first: before anything can start cuBLAS
            make_deterministic()
        if strategy == "auto":
            strategy = os.environ.get(STRATEGY_VARIABLE) or strategy
        if devices is None:
            devices = os.environ.get(DEVICES_VARIABLE) or None
        spec = None if devices is None else str(devices)
        speed = SpeedOptions.of(compile, channels_last, fused_optimizer)
        self.config = RuntimeConfig(
            strategy,
            spec,
            normalize_precision(precision),
            seed,
            accumulate,
            sync_batchnorm,
            deterministic,
            speed,
            batch_size_per,
            StrategyOptions(
                normalize_precision(precision),
                tuple(fsdp_blocks),
                tuple(pipeline_split),
                pipeline_schedule,
                pipeline_microbatches,
            ),
            threads,
            oom,
            activation_checkpointing,
        ).validate()
        self.strategy: Strategy = build_strategy(strategy, spec, self.config.options)
        #: this process's intra-op threads, and those of the processes it starts
        self.threads: ThreadChoice = choose_for(self.strategy.num_processes, threads)
        if self.strategy.num_processes == 1 or launched():  # before torch's pools start
            apply_here(self.threads)
            # what this process has: OpenMP read the wait policy when torch was imported
            policy = os.environ.get("OMP_WAIT_POLICY") or "default"
            self.threads = dataclasses.replace(self.threads, wait_policy=policy)
        check_sync_batchnorm(self.strategy, sync_batchnorm)
        if activation_checkpointing and not self.strategy.allows_activation_checkpointing:
            raise UserError(
                "--activation-checkpointing does not work with --strategy "
                f"{self.strategy.name}: its replicas of the model run the blocks' original "
                "forward; use ddp or fsdp"
            )
        self.speed = Speed(speed, self.strategy)
        self.precision = Precision(self.config.precision, self.strategy.root_device)
        self.seed = seed
        self.accumulation = Accumulation(steps=accumulate)
        #: non-finite losses (PARATRAIN_NONFINITE); counts the optimizer steps
        self.nonfinite = NonFiniteCheck()
        #: --oom auto: how many pieces each micro-batch is cut into
        #: why --oom auto cannot work under this strategy (said once, at rt.setup), or None
        self._oom_refused = self.strategy.oom_refused() if oom == "auto" else None
        #: what a model built on the meta device is initialised from (rt.setup's init_seed)
        self._init_seed: int | None = seed
        self.micro_batches = MicroBatches("off" if self._oom_refused else oom)
        self._connected = False
        self._stop: preemption.Request | None = None
        #: an evaluation loop ran under several processes and nothing was all-reduced since
        self._unreduced_evaluation = False
        self._told: set[str] = set()  # the evaluation notes, each said once
        if seed is not None:
            seed_everything(seed)

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> Runtime:
        return cls(
            config.strategy,
            config.devices,
            config.precision,
            config.seed,
            config.accumulate,
            config.sync_batchnorm,
            config.deterministic,
            config.speed.compile,
            config.speed.channels_last,
            config.speed.fused_optimizer,
            config.batch_size_per,
            config.options.fsdp_blocks,
            config.options.pipeline_split,
            config.options.pipeline_schedule,
            config.options.pipeline_microbatches,
            config.threads,
            config.oom,
            config.activation_checkpointing,
        )

    @property
    def accumulate_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.accumulation.steps

    @property
    def sync_gradients(self) -> bool:
        """Whether the next ``optimizer.step()`` applies the gradients (False while
        accumulating micro-batches)."""
        return self.accumulation.sync_gradients

    # -- where am I --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.strategy.root_device

    @property
    def rank(self) -> int:
        return self.strategy.collective.rank

    @property
    def local_rank(self) -> int:
        return self.strategy.collective.local_rank

    @property
    def world_size(self) -> int:
        return self.strategy.collective.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _connect(self) -> None:
        heartbeat.beat()  # every collective and setup passes here: progress for the watchdog
        if not self._connected:
            self.strategy.setup_process()
            self._connected = True

    # -- processes ---------------------------------------------------------------------------
    def launch(self, fn: Callable[..., T], *args: Any) -> T | None:
        """Run ``fn(rt, *args)`` in as many processes as the strategy needs.

        Returns ``fn``'s result; when processes were spawned, rank 0's. Spawned processes
        get ``fn`` and ``args`` pickled: define ``fn`` at the top level of a module.
        """
        rebuild = functools.partial(Runtime.from_config, self.config)
        processes = self.strategy.num_processes
        return launch(
            self, processes, rebuild, fn, *args, environment=self.threads.child_environment()
        )

    # -- placing things ----------------------------------------------------------------------
    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        init_seed: int | None = None,
    ) -> Any:
        """Place ``model`` (and the optimizer's state) and wrap them for the strategy.

        Returns what it was given, in the same order: ``model``, ``(model, optimizer)``,
        ``(model, loss_fn)`` or ``(model, optimizer, loss_fn)``. A model built on the meta
        device gets its weights from ``init_seed`` (default: the runtime's ``seed``), each
        process only its part (:mod:`paratrain.meta_init`).
        """
        self._connect()
        self._init_seed = init_seed if init_seed is not None else self.seed
        with self.strategy.collective.operation("rt.setup"):  # DDP broadcasts the weights
            return self._setup(model, optimizer, loss_fn)

    def _setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[..., torch.Tensor] | None,
    ) -> Any:
        if self.strategy.needs_loss_fn and loss_fn is None:
            raise UserError(
                f"strategy {self.strategy.name} computes the loss on every device: "
                "pass the loss function too, rt.setup(model, optimizer, loss_fn)"
            )
        if self._oom_refused is not None:
            self._tell(
                "oom",
                f"--oom auto: out-of-memory recovery is not available under --strategy "
                f"{self.strategy.name} ({self._oom_refused}); running out of memory stops "
                "the run",
            )
        if is_meta(model):  # built on the meta device: weights from the seed, part by part
            self._materialize(model)
        if self.config.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if self.config.activation_checkpointing:  # before fsdp: its hooks wrap the blocks
            apply_activation_checkpointing(model, self.config.options.fsdp_blocks)
        self.strategy.place_model(model)  # pipeline: only this process's stage, in wrap_model
        self.speed.prepare_model(model)
        wrapped = self.strategy.wrap_model(model)
        if optimizer is not None:
            self.strategy.rebind_optimizer(optimizer)  # fsdp: the sharded parameters
        wrapped = self.speed.wrap_model(wrapped, self.precision.name, self.precision.autocast)
        if len(self.strategy.devices) == 1:  # DataParallel scatters inputs itself
            wrapped = guard_forward(wrapped, self.device)
        wrapped = self.precision.wrap_forward(wrapped)
        if self.config.deterministic:
            wrapped.forward = naming_nondeterministic(wrapped.forward)
        result: list[Any] = [wrapped]
        if optimizer is not None:
            result.append(self._setup_optimizer(model, optimizer))
        if loss_fn is not None:
            loss_fn = self.strategy.wrap_loss(loss_fn)
            result.append(
                naming_nondeterministic(loss_fn) if self.config.deterministic else loss_fn
            )
        return result[0] if len(result) == 1 else tuple(result)

    def _materialize(self, model: nn.Module) -> None:
        seed = self._init_seed
        if seed is None:
            raise UserError(
                "the model is on the meta device: paratrain gives it its weights from the "
                "run's seed; pass Runtime(seed=N), or build the model on a real device"
            )
        init = MetaInit(model, seed)
        if self.strategy.builds_parts:
            self.strategy.meta_init = init  # wrap_model materialises this process's part
        else:
            init.materialize([model])

    def _setup_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        model_params = {id(p) for p in model.parameters()}
        for group in optimizer.param_groups:
            # pipeline: other stages' parameters are meta placeholders (rebind_optimizer)
            if any(id(p) not in model_params and not p.is_meta for p in group["params"]):
                raise UserError(
                    "the optimizer holds parameters that are not the model's; build it from "
                    "model.parameters() of the model you pass to rt.setup"
                )
        move_optimizer_state(optimizer, self.device)
        self.speed.prepare_optimizer(optimizer)
        if self.precision.scaler is None and self.accumulate_steps == 1:
            return optimizer
        return RuntimeOptimizer(optimizer, self.precision, self.accumulation)  # type: ignore[return-value]

    def setup_loader(
        self,
        loader: DataLoader[Any],
        evaluation: bool = False,
        *,
        data_path: str = "auto",
        device_budget_gib: float | None = None,
    ) -> DeviceLoader:
        """Deliver ``loader``'s batches on this process's device, sharded across processes.

        Every layout sees the same global batches (the loader's ``batch_size`` is the global
        batch; with ``batch_size_per="process"`` each process's, so the global batch is
        ``batch_size`` x processes). ``evaluation=True``: every sample exactly once over all
        processes, no padding. ``data_path``: how batches are made (auto, loader, batched,
        device; see :mod:`paratrain.data_paths`), the same batches whichever.
        """
        self._connect()
        shards = self.strategy.data_shards
        batch_size = loader.batch_size
        if batch_size is not None:
            batch_size = global_batch_size(batch_size, self.config.batch_size_per, shards)
        device_loader = setup_data_path(
            loader,
            device=self.device,
            rank=self.strategy.data_rank,
            world_size=shards,
            seed=self.seed,
            evaluation=evaluation,
            sink=None if evaluation else self.accumulation,
            data_path=data_path,
            device_budget_gib=device_budget_gib,
            batch_size=batch_size,
            agree=self._agree_seed if self.world_size > 1 else None,
        )
        if self.strategy.data_shards > 1:
            device_loader.on_no_grad = self._evaluation_loop
        return device_loader

    def _evaluation_loop(self, loader: DeviceLoader) -> None:
        """A loader iterated under ``torch.no_grad()`` while processes share the data: each
        process sees only its part, so its sums are partial until all-reduced."""
        self._unreduced_evaluation = True
        if not loader.evaluation:
            self._tell(
                "training-loader",
                "a loader set up for training is iterated under torch.no_grad() (an "
                f"evaluation?) by {self.strategy.data_shards} processes: each sees only its "
                "part of the data, and a last batch smaller than the number of processes is "
                "dropped. For evaluation, set it up with rt.setup_loader(loader, "
                "evaluation=True) (every sample exactly once) and sum the counts with "
                "rt.all_reduce before printing them (docs/porting.md)",
            )

    def _tell(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            self.strategy.collective.note(f"paratrain: note: {message}")

    def _agree_seed(self, seed: int) -> int:
        """Rank 0's draw of a loader's permutation seed, on every process."""
        collective = self.strategy.collective
        with collective.operation("the shuffle of a loader (at the start of its epoch)"):
            return int(collective.broadcast_object(seed))

    def to_device(self, obj: T) -> T:
        """Move tensors (nested in tuples, lists, dicts) to this process's device."""
        return move_to_device(obj, self.device)  # type: ignore[no-any-return,unused-ignore]

    # -- the step ----------------------------------------------------------------------------
    def forward_backward(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        inputs: Any,
        target: Any,
    ) -> torch.Tensor:
        """``loss = loss_fn(model(inputs), target)`` and ``rt.backward(loss)`` in one call,
        which every strategy runs, ``pipeline`` included (there forward and backward run
        together, micro-batch by micro-batch). Returns the loss."""
        if self.micro_batches.active:
            return PieceStep(
                self.strategy,
                self.accumulation,
                self.nonfinite,
                self.micro_batches,
                self._precision_backward,
            ).run(model, loss_fn, inputs, target)
        if not self.strategy.trains_in_pipeline:
            loss = loss_fn(model(inputs), target)
            self.backward(loss)
            return loss
        with self.strategy.collective.operation("rt.forward_backward"):
            return self._pipeline_step(model, loss_fn, inputs, target)

    def _pipeline_step(
        self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, target: Any
    ) -> torch.Tensor:
        accumulation = self.accumulation
        ends_step = accumulation.next_is_last()
        scale = accumulation.loss_weight / accumulation.steps
        with heartbeat.waiting():
            loss = self.strategy.train_step(model, inputs, target, loss_fn, scale)
            loss = faults.at_step(self.rank, self.nonfinite.step + 1, loss)
            # the gradients are there already: a skipped micro-batch's are dropped
            if not self.nonfinite.admit(loss, self.strategy.collective, ends_step):
                model.zero_grad(set_to_none=True)
        accumulation.micro_batch_done()
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the precision policy, scaled for accumulation."""
        if self.strategy.trains_in_pipeline:
            raise UserError(
                f"--strategy {self.strategy.name} runs forward and backward together: use "
                "loss = rt.forward_backward(model, loss_fn, x, y) instead of rt.backward(loss)"
            )
        if loss.dim() != 0:
            raise PlacementError("rt.backward expects a scalar loss tensor")
        with self.strategy.collective.operation("rt.backward"):  # the gradient all-reduce
            self._backward(loss)

    def _backward(self, loss: torch.Tensor) -> None:
        accumulation = self.accumulation
        ends_step = accumulation.next_is_last()
        loss = faults.at_step(self.rank, self.nonfinite.step + 1, loss)
        with heartbeat.waiting():  # the step's collectives: waits on the other ranks
            admitted = self.nonfinite.admit(loss, self.strategy.collective, ends_step)
            if admitted:
                scale = accumulation.loss_weight / accumulation.steps
                self._precision_backward(loss * scale if scale != 1.0 else loss)
                self.speed.after_backward()  # --compile: the first step checked against eager
        accumulation.micro_batch_done()  # a skipped micro-batch too: on every rank alike

    def _precision_backward(self, loss: torch.Tensor) -> None:
        backward = self.precision.backward
        if self.config.deterministic:
            backward = naming_nondeterministic(backward)
        backward(loss)

    @property
    def step_skipped(self) -> bool:
        """Whether the last ``rt.backward`` was skipped for a non-finite loss
        (``--skip-nonfinite`` / ``PARATRAIN_NONFINITE=skip``)."""
        return self.nonfinite.skipped

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Call before clipping gradients: under fp16 with a GradScaler they are scaled
        (by 65,536 at first) until ``optimizer.step()``; elsewhere this does nothing."""
        unscale = getattr(optimizer, "unscale_gradients", None)
        if unscale is not None:  # the optimizer rt.setup wrapped (RuntimeOptimizer)
            unscale()

    def join(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Wrap a loop whose ranks may get different numbers of batches (torch's ``Join``):
        a rank that runs out waits for the others instead of hanging them."""
        return join_uneven(model, self.nonfinite)

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module) -> Iterator[None]:
        """Wrap forward and backward of one micro-batch: skips the gradient all-reduce on
        every micro-step but the last of each group of ``accumulate``."""
        last = self.accumulation.next_is_last()
        with contextlib.nullcontext() if last else self.strategy.no_sync(model):
            yield

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast, for code outside the model's forward."""
        return self.precision.autocast()

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._connect()
        self._unreduced_evaluation = False
        with self.strategy.collective.operation("rt.all_reduce"):
            self.nonfinite.agree(self.strategy.collective, "all_reduce")
            return self.strategy.collective.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._connect()
        self._unreduced_evaluation = False
        with self.strategy.collective.operation("rt.all_gather"):
            self.nonfinite.agree(self.strategy.collective, "all_gather")
            return self.strategy.collective.all_gather(tensor)

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        self._connect()
        with self.strategy.collective.operation("rt.broadcast_object"):
            self.nonfinite.agree(self.strategy.collective, "broadcast_object")
            return self.strategy.collective.broadcast_object(obj, src)  # type: ignore[no-any-return,unused-ignore]

    def barrier(self) -> None:
        self._connect()
        with self.strategy.collective.operation("rt.barrier"):
            self.nonfinite.agree(self.strategy.collective, "barrier")
            self.strategy.collective.barrier()

    # -- stopping on a signal ----------------------------------------------------------------
    def should_stop(self) -> bool:
        """Whether to stop after this step because SIGTERM, SIGUSR1 or Ctrl-C reached any
        process (:mod:`paratrain.preemption`). Call it on every process at the same points,
        once per optimizer step: the processes agree with one small all-reduce. The first
        call installs the signal handlers; a second Ctrl-C still stops at once."""
        self._connect()
        self._stop = preemption.agree(self.strategy.collective)
        return self._stop is not None

    def exit_stopped(
        self, checkpoint: str | os.PathLike[str] | None = None, step: int | None = None
    ) -> NoReturn:
        """After ``should_stop()`` and your ``rt.save``: print one line on the main process
        (the signal, the step, the checkpoint, seconds since the signal) and raise
        :class:`~paratrain.preemption.Stopped`, a ``SystemExit`` with code 128 + the
        signal's number."""
        request = self._stop or preemption.requested()
        if request is None:
            raise UserError("rt.exit_stopped() is for after rt.should_stop() returned True")
        path = None if checkpoint is None else Path(checkpoint)
        message = preemption.stop_message(request, step, path, time.time() - request.at)
        if self.is_main:
            print(message, file=sys.stderr, flush=True)
        self._stop = None
        preemption.clear()
        raise preemption.Stopped(request, message)

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        """Save ``state`` to the file ``path``: modules (plain parameter names), optimizers,
        LR schedulers and GradScalers (their ``state_dict()``), tensors, plain values, and
        every process's random generator states. Call it on every process; the main one
        writes, atomically, and all return once the file is complete."""
        self._connect()
        with self.strategy.collective.operation("rt.save"):
            save_state(self.strategy.collective, self.strategy.devices, path, state)

    def load(
        self, path: str | os.PathLike[str], into: dict[str, Any] | None = None, rng: bool = True
    ) -> dict[str, Any]:
        """Read a file :meth:`save` wrote, on every process: load its entries into the
        objects of ``into`` (same keys as saved) and, with ``rng`` and the same number of
        processes, restore this process's random generators. Returns every saved entry."""
        self._connect()
        with self.strategy.collective.operation("rt.load"):
            return load_state(self.strategy.collective, self.strategy.devices, path, into, rng)

    def save_weights(self, model: nn.Module, path: str | os.PathLike[str]) -> None:
        """Write ``model``'s full weights with plain names to ``path`` (safetensors). Call it
        on every process: sharded (fsdp) weights are gathered, the main process writes."""
        self._connect()
        with self.strategy.collective.operation("rt.save_weights"):
            save_model_weights(self.strategy.collective, model, path)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only. After an evaluation loop under several
        processes with no ``rt.all_reduce`` since, it says once that the values are the main
        process's part alone."""
        if self._unreduced_evaluation:
            shards = self.strategy.data_shards
            self._tell(
                "unreduced-print",
                f"rt.print after an evaluation loop with no rt.all_reduce since: what it "
                f"prints was counted by the main process alone, on about 1/{shards} of the "
                "data. Sum per-process counts first, e.g. correct = "
                "rt.all_reduce(torch.tensor(correct)).item() (docs/porting.md)",
            )
        if self.is_main:
            print(*args, **kwargs)

    def teardown(self) -> None:
        self.strategy.teardown()
        self._connected = False

    def describe(self) -> dict[str, Any]:
        return {
            **self.strategy.describe(),
            "precision": self.precision.name,
            "world_size": self.world_size,
            "accumulate": self.accumulate_steps,
            "deterministic": self.config.deterministic,
            **self.micro_batches.describe(),
            "activation_checkpointing": self.config.activation_checkpointing,
            "numerics": numerics_settings(),
            "threads": self.threads.describe(),
            **self.speed.describe(),
        }
