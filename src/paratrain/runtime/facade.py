"""The facade users put in their own training loop.

    rt = paratrain.Runtime(strategy="auto")
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.setup_loader(loader)
    ...
    rt.backward(loss)

The runtime holds a :class:`~paratrain.strategies.Strategy` and a
:class:`~paratrain.devices.precision.Precision` and delegates to them; it never asks which strategy
it runs.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from paratrain.data.loaders import DeviceLoader
from paratrain.data.placement import move_to_device
from paratrain.devices.precision import Precision
from paratrain.distributed.collective import ReduceOp
from paratrain.launching import heartbeat
from paratrain.launching.launch import launch
from paratrain.launching.launcher import at_healthy_exit
from paratrain.launching.threads import ThreadChoice
from paratrain.runtime.config import (
    DEVICES_VARIABLE,
    STRATEGY_VARIABLE,
    RuntimeConfig,
    runtime_help,
)
from paratrain.runtime.determinism import make_deterministic
from paratrain.runtime.groups import MethodGroups
from paratrain.runtime.nonfinite import NonFiniteCheck
from paratrain.runtime.oom import MicroBatches
from paratrain.runtime.parts import assemble, describe
from paratrain.runtime.seeding import seed_everything
from paratrain.runtime.speed import Speed
from paratrain.runtime.step_state import StepState
from paratrain.runtime.uneven import join_uneven
from paratrain.strategies import Strategy, StrategyChoice

T = TypeVar("T")

__all__ = ["DEVICES_VARIABLE", "STRATEGY_VARIABLE", "Runtime", "RuntimeConfig"]  # re-exported


class Runtime:
    """Places models, optimizers and batches for one strategy; runs the collectives."""

    def __init__(
        self,
        strategy: str | StrategyChoice = "auto",
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
        nonfinite: str | None = None,
        hang_timeout: float | None = None,
        agreement_seconds: float = 1.0,
        collective_check: bool = True,
        replicate: int = 1,
        tp: int = 1,
    ) -> None:
        # the keywords, each declared once in RuntimeConfig (the docstring, set below this
        # class, lists them from their declarations)
        arguments = {name: value for name, value in locals().items() if name != "self"}
        self._start(RuntimeConfig.of(**arguments))

    def _start(self, config: RuntimeConfig) -> None:
        if config.deterministic:  # first: before anything can start cuBLAS
            make_deterministic()
        self._parts = assemble(config)
        self._connected = False
        self._checked_at_exit = False
        self._groups = MethodGroups.of(self._parts)  # what this facade delegates to
        if config.seed is not None:  # last: nothing above draws random numbers
            seed_everything(config.seed)

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> Runtime:
        """The runtime of ``config`` (spawned processes rebuild theirs from the parent's)."""
        rt = cls.__new__(cls)
        rt._start(config)
        return rt

    # -- its parts (paratrain.runtime.parts), each held once --------------------------------
    @property
    def config(self) -> RuntimeConfig:
        """The runtime's configuration, every option in force."""
        return self._parts.config

    @property
    def strategy(self) -> Strategy:
        """The strategy the runtime delegates to (its processes, devices and wrappers)."""
        return self._parts.strategy

    @property
    def threads(self) -> ThreadChoice:
        """This process's intra-op threads, and those of the processes it starts."""
        return self._parts.threads

    @property
    def speed(self) -> Speed:
        """The speed options applied (compile and its check, channels last, fused steps)."""
        return self._parts.speed

    @property
    def precision(self) -> Precision:
        return self._parts.precision

    @property
    def seed(self) -> int | None:
        return self._parts.config.seed

    @property
    def state(self) -> StepState:
        """Where training stands: optimizer steps, the accumulation group, the micro-batch in
        hand, the step's agreement (:mod:`paratrain.runtime.step_state`)."""
        return self._parts.state

    @property
    def nonfinite(self) -> NonFiniteCheck:
        """The policy for non-finite losses (``nonfinite=``, ``--skip-nonfinite``)."""
        return self._parts.nonfinite

    @property
    def micro_batches(self) -> MicroBatches:
        """``--oom auto``: how many pieces each micro-batch is cut into."""
        return self._parts.micro_batches

    @micro_batches.setter
    def micro_batches(self, value: MicroBatches) -> None:
        self._parts.micro_batches = value

    @property
    def oom_refused(self) -> str | None:
        """Why ``oom="auto"`` cannot work under this strategy, or None."""
        return self._parts.oom_refused

    @property
    def init_seed(self) -> int | None:
        """What a model built on the meta device gets its weights from."""
        return self._parts.init_seed

    @property
    def accumulate_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.state.accumulate

    @property
    def sync_gradients(self) -> bool:
        """Whether the next ``optimizer.step()`` applies the gradients (False while
        accumulating micro-batches)."""
        return self.state.sync_gradients

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
            heartbeat.announce_place(self.strategy.place)  # named in a hang report
            self._connected = True
            if self.strategy.collective.world_size > 1 and not self._checked_at_exit:
                at_healthy_exit(self._check_at_exit)
                self._checked_at_exit = True

    def _check_at_exit(self) -> None:
        """A script that ends without rt.settle still has its last steps' checks read
        (at the pace of ``agreement_seconds`` they may be behind): a NaN is said, exit 1."""
        if self._connected and torch.distributed.is_initialized():
            self._groups.step.settle()

    # -- processes ---------------------------------------------------------------------------
    def launch(self, fn: Callable[..., T], *args: Any) -> T | None:
        """Run ``fn(rt, *args)`` in as many processes as the strategy needs.

        Returns ``fn``'s result; when processes were spawned, rank 0's. Spawned processes
        get ``fn`` and ``args`` pickled: define ``fn`` at the top level of a module.
        """
        rebuild = functools.partial(Runtime.from_config, self.config)
        env = self.threads.child_environment()
        processes = self.strategy.num_processes
        hang = self.config.hang_timeout
        return launch(self, processes, rebuild, fn, *args, environment=env, hang_seconds=hang)

    # -- placing things ----------------------------------------------------------------------
    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        scheduler: Any = None,
        *,
        init_seed: int | None = None,
    ) -> Any:
        """Place ``model`` (and the optimizer's state) and wrap them for the strategy.

        Returns what it was given, in the same order: ``model``, ``(model, optimizer)``,
        ``(model, loss_fn)``, ``(model, optimizer, loss_fn)``, ``(model, optimizer,
        scheduler)`` or ``(model, optimizer, loss_fn, scheduler)``. The LR scheduler
        returned (the same class, the same ``state_dict()``) advances only when
        ``optimizer.step()`` applied gradients: once per group of ``accumulate``
        micro-batches, not after a step skipped for a non-finite loss or by a GradScaler.
        A model built on the meta device gets its weights from ``init_seed`` (default: the
        runtime's ``seed``), each process only its part (:mod:`paratrain.models.meta_init`).
        """
        self._connect()
        self._parts.init_seed = init_seed if init_seed is not None else self.seed
        with self.strategy.collective.operation("rt.setup"):  # DDP broadcasts the weights
            return self._groups.setup.model(model, optimizer, loss_fn, scheduler)

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
        device; see :mod:`paratrain.data.paths`), the same batches whichever. An
        ``IterableDataset`` is split by item across workers and processes
        (:mod:`paratrain.data.iterable_split`).
        """
        self._connect()
        return self._groups.setup.loader(loader, evaluation, data_path, device_budget_gib)

    def to_device(self, obj: T) -> T:
        """Move tensors (nested in tuples, lists, dicts) to this process's device."""
        return move_to_device(obj, self.device)  # type: ignore[no-any-return,unused-ignore]

    # -- the step ----------------------------------------------------------------------------
    def forward_backward(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor] | None,
        inputs: Any,
        target: Any,
    ) -> torch.Tensor:
        """``loss = loss_fn(model(inputs), target)`` and ``rt.backward(loss)`` in one call,
        which every strategy runs, ``pipeline`` included (there forward and backward run
        together, micro-batch by micro-batch). Returns the loss. ``loss_fn=None``: the
        model's own loss, ``model(inputs, labels=target).loss`` (Hugging Face's models;
        under ``pipeline``, a GPT-2 or Llama decoder's, computed on the last stage)."""
        return self._groups.step.forward_backward(model, loss_fn, inputs, target)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the precision policy, scaled for accumulation."""
        self._groups.step.backward(loss)

    @property
    def step_skipped(self) -> bool:
        """Whether the last ``rt.backward`` was skipped for a non-finite loss
        (``--skip-nonfinite`` / ``PARATRAIN_NONFINITE=skip``)."""
        return self.state.skipped

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Call before clipping gradients: under fp16 with a GradScaler they are scaled
        (by 65,536 at first) until ``optimizer.step()``; elsewhere this does nothing."""
        unscale = getattr(optimizer, "unscale_gradients", None)
        if unscale is not None:  # the optimizer rt.setup wrapped (RuntimeOptimizer)
            unscale()

    def join(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Wrap a loop whose ranks may get different numbers of batches (torch's ``Join``):
        a rank that runs out waits for the others instead of hanging them."""
        return join_uneven(model, self.state)

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module) -> Iterator[None]:
        """Wrap forward and backward of one micro-batch: skips the gradient all-reduce on
        every micro-step but the last of each group of ``accumulate`` (decided when the
        micro-batch's forward begins, from the batch itself)."""
        with self._groups.step.accumulate(model):
            yield

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast, for code outside the model's forward."""
        return self.precision.autocast()

    # -- collectives (paratrain.runtime.collectives) -----------------------------------------
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = "sum", *, over: str = "data"
    ) -> torch.Tensor:
        """``tensor`` combined (``op``: sum, mean, max, min) over the parts of the data, one
        value per part, returned on every process: a count made from the batches of
        ``rt.setup_loader`` then counts each sample once on every layout. Every process holds
        a part of its own, except under ``pipeline``, where a pipeline's stages share one
        batch: its first stage's value counts, once. ``over="processes"``: every process's
        value (what differs between a pipeline's stages). Call it on every process."""
        self._connect()
        return self._groups.collectives.all_reduce(tensor, op, over)

    def all_gather(self, tensor: torch.Tensor, *, over: str = "data") -> list[torch.Tensor]:
        """``tensor`` from each part of the data, in rank order, on every process: one per
        process, one per pipeline under ``pipeline`` (see ``all_reduce``);
        ``over="processes"``: one per process everywhere. The first dimension may differ
        between processes (an evaluation loader's uneven last batch); each part comes back
        at its own length."""
        self._connect()
        return self._groups.collectives.all_gather(tensor, over)

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        self._connect()
        return self._groups.collectives.broadcast_object(obj, src)

    def barrier(self) -> None:
        self._connect()
        self._groups.collectives.barrier()

    # -- stopping on a signal (paratrain.runtime.stop) ---------------------------------------
    def should_stop(self) -> bool:
        """Whether to stop after this step because SIGTERM, SIGUSR1 or Ctrl-C reached any
        process (:mod:`paratrain.launching.preemption`). Call it on every process at the same
        points,
        once per optimizer step: the processes agree in the step's own small all-reduce (a
        signal that arrives after it stops every process one step later), or in one of its
        own when no step ran since the last call. The first
        call installs the signal handlers; a second Ctrl-C still stops at once."""
        self._connect()
        return self._groups.stop.agree()

    def exit_stopped(
        self, checkpoint: str | os.PathLike[str] | None = None, step: int | None = None
    ) -> NoReturn:
        """After ``should_stop()`` and your ``rt.save``: print one line on the main process
        (the signal, the step, the checkpoint, seconds since the signal) and raise
        :class:`~paratrain.launching.preemption.Stopped`, a ``SystemExit`` with code 128 + the
        signal's number."""
        self._groups.stop.exit(checkpoint, step)

    # -- checkpoints (paratrain.runtime.checkpoints) -----------------------------------------
    def save(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        """Save ``state`` to the file ``path``: modules (plain parameter names), optimizers,
        LR schedulers and GradScalers (their ``state_dict()``), tensors, plain values, and
        every process's random generator states. Call it on every process; the main one
        writes, atomically, and all return once the file is complete."""
        self._connect()
        self._groups.step.settle()  # the last step's checks are read before anything is written
        self._groups.checkpoints.save(path, state)

    def load(
        self, path: str | os.PathLike[str], into: dict[str, Any] | None = None, rng: bool = True
    ) -> dict[str, Any]:
        """Read a file :meth:`save` wrote, on every process: load its entries into the
        objects of ``into`` (same keys as saved) and, with ``rng`` and the same number of
        processes, restore this process's random generators. Returns every saved entry."""
        self._connect()
        return self._groups.checkpoints.load(path, into, rng)

    def save_weights(self, model: nn.Module, path: str | os.PathLike[str]) -> None:
        """Write ``model``'s full weights with plain names to ``path`` (safetensors). Call it
        on every process: sharded (fsdp) weights are gathered, the main process writes."""
        self._connect()
        self._groups.step.settle()
        self._groups.checkpoints.save_weights(model, path)

    def settle(self) -> None:
        """Read the checks of the steps so far now (a non-finite loss raises here). A step's
        checks travel in a small all-reduce that is read later, so the host never waits for
        the device inside a step; ``rt.save``, ``rt.save_weights``, ``rt.should_stop`` and the
        runtime's collectives read them first. Call it on every process before writing
        anything of your own that must not come from a step with a NaN loss."""
        self._connect()
        self._groups.step.settle()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only. After an evaluation loop under several
        processes with no ``rt.all_reduce`` since, it says once that the values are the main
        process's part alone."""
        self._groups.notes.before_print()
        if self.is_main:
            print(*args, **kwargs)

    def teardown(self) -> None:
        """Leave the process group, every process together, after reading the last steps'
        checks (a non-finite loss raises here)."""
        if self._connected:
            self._groups.step.settle()
        self.strategy.teardown()
        self._connected = False

    def describe(self) -> dict[str, Any]:
        return describe(self._parts)


Runtime.__init__.__doc__ = runtime_help()
