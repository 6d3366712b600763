"""What ``rt.setup`` applies to a model, its optimizer, its loss function and its LR
scheduler, in order: SyncBatchNorm, activation checkpointing, placement, the speed options,
the strategy's wrapper, the device guard, the precision's forward and the deterministic-mode
names, the accumulating optimizer and the scheduler that follows it; and what
``rt.setup_loader`` applies to a loader (the global batch, the data path, the shard)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from paratrain.data.loaders import BATCH_INFO, BatchInfo, DeviceLoader, batch_info
from paratrain.data.paths import setup_data_path
from paratrain.data.pipeline_loader import PipelineLoader
from paratrain.data.placement import check_inputs_on
from paratrain.data.wds_pipeline import unwrap_web_loader
from paratrain.devices.precision import Precision, to_float32
from paratrain.models.meta_init import MetaInit, is_meta
from paratrain.runtime.activation_checkpointing import apply_activation_checkpointing
from paratrain.runtime.batching import global_batch_size
from paratrain.runtime.determinism import naming_nondeterministic
from paratrain.runtime.optim import RuntimeOptimizer, move_optimizer_state, warn_once_on_main
from paratrain.runtime.parts import RuntimeParts
from paratrain.runtime.random_layers import dropout_note
from paratrain.runtime.schedulers import gate_scheduler, is_scheduler
from paratrain.strategies import Strategy
from paratrain.utils.errors import UserError


class StepHooks(Protocol):
    """What the model's forward tells the step pipeline (:mod:`paratrain.runtime.step`)."""

    def begin(self, info: BatchInfo | None) -> None: ...

    def forward_failed(self, exc: torch.OutOfMemoryError) -> None: ...


class RuntimeSetup:
    """What ``rt.setup`` and ``rt.setup_loader`` apply, with the runtime's parts."""

    def __init__(
        self,
        rt: RuntimeParts,
        agree_seed: Callable[[int], int],
        loop_started: Callable[[DeviceLoader], None],
        tell: Callable[[str, str], None],
        step: StepHooks,
    ) -> None:
        self.rt = rt
        self.agree_seed = agree_seed
        self.loop_started = loop_started
        self.tell = tell  # a note said once, on the main process
        self.step = step

    def model(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[..., torch.Tensor] | None,
        scheduler: Any = None,
    ) -> Any:
        """What it was given, in the same order (``model``, then the optimizer, the loss
        function and the scheduler given), placed and wrapped. A scheduler given in the
        loss function's place (``rt.setup(model, optimizer, scheduler)``) is one."""
        if scheduler is None and loss_fn is not None and is_scheduler(loss_fn):
            loss_fn, scheduler = None, loss_fn  # returned in the same place all the same
        if scheduler is not None and optimizer is None:
            raise UserError(
                "rt.setup: an LR scheduler follows its optimizer's steps: hand the optimizer "
                "too, rt.setup(model, optimizer, scheduler)"
            )
        rt = self.rt
        strategy, config = rt.strategy, rt.config
        if strategy.needs_loss_fn and loss_fn is None and not _computes_its_loss(model):
            raise UserError(
                f"strategy {strategy.name} computes the loss on every device: "
                "pass the loss function too, rt.setup(model, optimizer, loss_fn), or use a "
                "model that computes its own (a forward taking labels=...: outputs.loss)"
            )
        self._notes(model)
        if is_meta(model):  # built on the meta device: weights from the seed, part by part
            self._materialize(model)
        if config.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if config.activation_checkpointing:  # before fsdp: its hooks wrap the blocks
            apply_activation_checkpointing(model, config.options.fsdp_blocks)
        strategy.place_model(model)  # pipeline: only this process's stage, in wrap_model
        rt.speed.prepare_model(model)
        wrapped = strategy.wrap_model(model)
        if optimizer is not None:
            strategy.rebind_optimizer(optimizer)  # fsdp: the sharded parameters
        wrapped = rt.speed.wrap_model(wrapped, rt.precision.name, rt.precision.autocast)
        # DataParallel scatters inputs from any device itself: no device advice there
        guard = strategy.root_device if len(strategy.devices) == 1 else None
        wrapped.forward = step_forward(
            wrapped.forward, self.step, guard, rt.precision, config.deterministic
        )
        result: list[Any] = [wrapped]
        if optimizer is not None:
            optimizer = self._setup_optimizer(model, optimizer)
            result.append(optimizer)
        if loss_fn is not None:
            loss_fn = strategy.wrap_loss(loss_fn)
            result.append(naming_nondeterministic(loss_fn) if config.deterministic else loss_fn)
        if scheduler is not None:
            steps = optimizer._paratrain_steps if isinstance(optimizer, RuntimeOptimizer) else None
            result.append(gate_scheduler(scheduler, optimizer, steps))
        return result[0] if len(result) == 1 else tuple(result)

    def _notes(self, model: nn.Module) -> None:
        """What the run cannot promise for this model, said once at its setup."""
        rt = self.rt
        if rt.oom_refused is not None:
            self.tell(
                "oom",
                "--oom auto: out-of-memory recovery is not available under "
                f"--strategy {rt.strategy.name} ({rt.oom_refused}); running out of memory "
                "stops the run",
            )
        dropout = dropout_note(model, len(rt.strategy.devices))
        if dropout is not None:
            self.tell("dropout", dropout)

    def _materialize(self, model: nn.Module) -> None:
        seed = self.rt.init_seed
        if seed is None:
            raise UserError(
                "the model is on the meta device: paratrain gives it its weights from the "
                "run's seed; pass Runtime(seed=N), or build the model on a real device"
            )
        init = MetaInit(model, seed)
        if self.rt.strategy.builds_parts:
            self.rt.strategy.meta_init = init  # wrap_model materialises this process's part
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
        rt = self.rt
        move_optimizer_state(optimizer, rt.strategy.root_device)
        rt.speed.prepare_optimizer(optimizer)
        # wrapped where a step may apply no gradient: then a scheduler must not advance
        skips = rt.nonfinite.policy == "skip"
        if rt.precision.scaler is None and rt.state.accumulate == 1 and not skips:
            # left as it is; its steps still end a group a loop makes by hand (rt.save)
            state = rt.state
            optimizer.register_step_post_hook(state.applied)
            return optimizer
        warn = warn_once_on_main(rt.strategy.collective.is_main)
        return RuntimeOptimizer(optimizer, rt.precision, rt.state, warn)  # type: ignore[return-value]

    def loader(
        self,
        loader: DataLoader[Any],
        evaluation: bool,
        data_path: str,
        device_budget_gib: float | None,
    ) -> DeviceLoader:
        """``loader``'s batches on this process's device, this process's shard of them; the
        processes agree on each epoch's shuffle, and an evaluation loop over shards is
        noted until its sums are all-reduced."""
        rt = self.rt
        loader = unwrap_web_loader(loader)  # a wds.WebLoader: its DataLoader
        shards = rt.strategy.data_shards
        if isinstance(loader.dataset, IterableDataset) and shards > 1 and evaluation:
            _refuse_uneven_forwards(rt.strategy, shards)
        batch_size = loader.batch_size
        if batch_size is not None:
            batch_size = global_batch_size(batch_size, rt.config.batch_size_per, shards)
        device_loader = setup_data_path(
            loader,
            device=rt.strategy.root_device,
            rank=rt.strategy.data_rank,
            world_size=shards,
            seed=rt.config.seed,
            evaluation=evaluation,
            sink=None if evaluation else rt.state,
            data_path=data_path,
            device_budget_gib=device_budget_gib,
            batch_size=batch_size,
            agree=self.agree_seed if rt.strategy.collective.world_size > 1 else None,
            count=self.count_samples if shards > 1 else None,
        )
        if isinstance(device_loader, PipelineLoader) and not evaluation:
            self.tell("webdataset", device_loader.note(shards, loader.num_workers))
        if shards > 1:
            device_loader.on_no_grad = self.loop_started
        if rt.config.sync_batchnorm and not evaluation:
            _refuse_stand_in_statistics(device_loader, shards)
        return device_loader

    def count_samples(self, mine: int) -> list[int]:
        """Every data part's samples in this step (a webdataset pipeline's parts differ)."""
        strategy = self.rt.strategy
        with strategy.collective.operation("rt.setup_loader's sample count"):
            gathered = strategy.collective.all_gather(torch.tensor(mine, dtype=torch.int64))
        return [int(gathered[rank]) for rank in strategy.data_leaders]


def _refuse_uneven_forwards(strategy: Strategy, shards: int) -> None:
    """An iterable data set's parts for evaluation may hold different numbers of batches
    (an empty part is skipped): refused where every forward is a collective (fsdp gathers
    the parameters in each)."""
    if strategy.collective_forward:
        raise UserError(
            f"--strategy {strategy.name}: an IterableDataset cannot be evaluated across its "
            f"{shards} processes, whose parts may hold different numbers of batches while "
            "every forward is a collective; use a map-style dataset (__len__ and __getitem__)"
        )


def _refuse_stand_in_statistics(loader: DeviceLoader, shards: int) -> None:
    """SyncBatchNorm's statistics would count a stand-in sample (a process with no sample of
    a last batch smaller than the number of processes trains on one of the others' with a
    loss weight of 0, :class:`~paratrain.data.loaders.ShardedBatchSampler`): refused."""
    sampler = loader.batch_sampler
    sizes = [] if sampler is None else sampler.global_batch_sizes()
    if sizes and sizes[-1] < shards:
        raise UserError(
            f"--sync-batchnorm: the epoch's last batch has {sizes[-1]} sample(s), fewer than "
            f"the {shards} processes, and a process with none of them has no batch "
            "statistics; choose a batch size that leaves at least "
            f"{shards}, or drop it with DataLoader(drop_last=True)"
        )


def _computes_its_loss(model: nn.Module) -> bool:
    """A forward that takes ``labels`` (Hugging Face's models): it returns its own loss."""
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def step_forward(
    forward: Callable[..., Any],
    step: StepHooks,
    guard: torch.device | None,
    precision: Precision,
    deterministic: bool,
) -> Callable[..., Any]:
    """The model's forward as the runtime runs it, in one wrapper: the step pipeline's
    micro-batch begins (its batch's loss weight and place in the accumulation group), the
    precision's autocast (outputs back to float32), a device mismatch explained (``guard``:
    the one device inputs belong on), and nondeterministic operations named."""
    autocast = precision.autocast if precision.dtype is not None else None

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():  # a training forward: evaluation begins nothing
            # model(x), the common call: one look-up (this runs at every forward)
            first = args[0] if args else None
            info = getattr(first, BATCH_INFO, None) if isinstance(first, torch.Tensor) else None
            step.begin(info if info is not None else batch_info(args, kwargs))
        try:
            if autocast is None:
                return forward(*args, **kwargs)
            with autocast():
                output = forward(*args, **kwargs)
            return to_float32(output)
        except torch.OutOfMemoryError as exc:
            step.forward_failed(exc)
            raise
        except RuntimeError as exc:
            if guard is not None and "device" in str(exc):
                check_inputs_on(guard, args, kwargs)
            raise

    return naming_nondeterministic(run) if deterministic else run
