"""The strategy contract.

A strategy says how one process trains: which device is its own, how the model and the loss
are wrapped, and how processes talk to each other (its :class:`Collective`). How processes
are *started* lives in :mod:`paratrain.launching.launch`, not here.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from paratrain.distributed.collective import Collective, ReduceOp
from paratrain.models.meta_init import MetaInit

__all__ = ["Collective", "ReduceOp", "Strategy", "StrategyOptions", "iter_tensors"]


@dataclass(frozen=True)
class StrategyOptions:
    """What a built strategy is given besides its devices: the run's settings it applies,
    and the options of its :class:`~paratrain.strategies.choices.StrategyChoice` (which
    refuses, before anything is built, an option its strategy does not read)."""

    #: the run's precision (``32``, ``bf16``, ``fp16``): FSDP gathers parameters in it
    precision: str = "32"
    #: FSDP: class names or module names of the blocks sharded as one unit each
    fsdp_blocks: tuple[str, ...] = ()
    #: pipeline: the modules that start stages 2, 3, ... (default: balanced by parameters)
    pipeline_split: tuple[str, ...] = ()
    #: pipeline: "1f1b" or "gpipe"
    pipeline_schedule: str = "1f1b"
    #: pipeline: micro-batches per batch (fewer where the batch does not split evenly)
    pipeline_microbatches: int = 4
    #: copies of the layout, data parallel across them; the layout's own dimension gets
    #: the processes // replicate (fsdp: HSDP, paratrain.distributed.mesh)
    replicate: int = 1
    #: processes that split each layer between them, tensor parallel (fsdp with the
    #: built-in GPT: paratrain.strategies.tensor_parallel)
    tp: int = 1
    #: the processes compare their collectives when one waits long in one
    #: (paratrain.distributed.collective_order); False: off
    collective_check: bool = True


class Strategy(ABC):
    """How one process trains. Subclasses register themselves by ``name``."""

    name: ClassVar[str]
    description: ClassVar[str]
    #: the loss function must be handed to ``Runtime.setup`` (the balanced DataParallel).
    needs_loss_fn: ClassVar[bool] = False
    #: BatchNorm statistics can be synchronized across this strategy's processes.
    syncs_batchnorm: ClassVar[bool] = False
    #: every process must run the same number of forwards (fsdp gathers parameters in each)
    collective_forward: ClassVar[bool] = False
    #: ``check_model`` refuses some models: `paratrain train` builds the model to ask first.
    checks_model: ClassVar[bool] = False
    #: forward and backward run together (``train_step``): ``rt.forward_backward`` only
    trains_in_pipeline: ClassVar[bool] = False
    #: ``--oom auto``'s pieces of a micro-batch each synchronize their gradients (fsdp:
    #: without, each process would hold the whole model's unsharded gradients)
    pieces_sync_each: ClassVar[bool] = False
    #: blocks may recompute their activations in the backward (not where replicas of the
    #: model run the original module's forward: DataParallel)
    allows_activation_checkpointing: ClassVar[bool] = True
    #: a model built on the meta device is materialised by ``wrap_model``, only this
    #: process's part (``meta_init``); the others get it whole before ``place_model``
    builds_parts: ClassVar[bool] = False
    #: its processes may span several machines (torchrun's agent on each, --nnodes)
    spans_machines: ClassVar[bool] = False
    #: each process holds a 1/N shard of the parameters and gathers them at every step: over
    #: several machines those gathers cross the network (``replicate`` keeps them inside one)
    gathers_shards: ClassVar[bool] = False
    #: the torch.compile mode ``--compile`` (``auto``) means here (paratrain.runtime.compiling)
    compile_mode: ClassVar[str] = "default"
    #: why ``--compile``'s first-step check cannot run its eager pass here, or None
    compile_check_refused: ClassVar[str | None] = None

    def __init__(self, devices: list[torch.device], options: StrategyOptions | None = None) -> None:
        self.devices = devices
        self.options = options or StrategyOptions()
        self.collective: Collective = Collective()
        #: set by ``Runtime.setup`` for ``builds_parts`` strategies given a meta model
        self.meta_init: MetaInit | None = None

    # -- chosen before any process exists ---------------------------------------------------
    @classmethod
    @abstractmethod
    def resolve_devices(cls, spec: str | None) -> list[torch.device]:
        """Turn ``--devices`` into this strategy's devices, or raise ``UserError``."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this strategy cannot run on this machine, or None if it can."""
        return None

    def precision_refused(self, precision: str) -> str | None:
        """Why this strategy cannot train in ``precision`` here, or None."""
        return None

    def compile_refused(self) -> str | None:
        """Why ``torch.compile`` cannot run this strategy's model, or None."""
        return None

    def oom_refused(self) -> str | None:
        """Why ``--oom auto`` cannot recover from running out of memory here, or None."""
        return None

    @classmethod
    def count_processes(cls, devices: list[torch.device]) -> int:
        """How many processes a run of this strategy on ``devices`` needs, without building
        it (the configuration asks before any process starts)."""
        return 1

    @property
    def place(self) -> str:
        """This process's coordinates in a two-dimensional layout (``"replicate 1, shard
        0"``), for reports that name it; ``""`` for a layout of one dimension."""
        return ""

    @property
    def num_processes(self) -> int:
        """How many processes a run of this strategy needs (the launcher starts them)."""
        return type(self).count_processes(self.devices)

    # -- inside each process ----------------------------------------------------------------
    def setup_process(self) -> None:  # noqa: B027  (optional hook)
        """Join the process group, pick this process's device. Nothing for one process."""

    @property
    def root_device(self) -> torch.device:
        """Where this process keeps the model and receives batches."""
        return self.devices[0]

    @property
    def data_shards(self) -> int:
        """Into how many parts the global batch is split across processes."""
        return self.collective.world_size

    @property
    def data_rank(self) -> int:
        """This process's part of the global batch, from 0 to ``data_shards - 1``."""
        return self.collective.rank

    @property
    def data_leaders(self) -> list[int]:
        """The ranks that stand for the data in ``rt.all_reduce`` and ``rt.all_gather``: one
        process per part of the data (here every process holds a part of its own)."""
        return list(range(self.collective.world_size))

    def check_model(self, model: nn.Module) -> None:  # noqa: B027  (optional hook)
        """Raise ``UserError`` if this strategy cannot train ``model``; called before any
        process starts where the model is known (``paratrain train``), and by ``wrap_model``."""

    def place_model(self, model: nn.Module) -> None:
        """Move ``model`` to this process's device, before ``wrap_model``."""
        model.to(self.root_device)

    @abstractmethod
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Wrap a model already moved to ``root_device``."""

    def rebind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: B027
        """Point an optimizer built before ``wrap_model`` at the parameters the model trains
        with now (FSDP replaces them by sharded ones). Nothing for most strategies."""

    def train_step(
        self,
        model: nn.Module,
        inputs: Any,
        target: Any,
        loss_fn: Callable[..., torch.Tensor] | None,
        scale: float,
    ) -> torch.Tensor | None:
        """Forward and backward of one batch together, for ``trains_in_pipeline``
        strategies; returns the batch's mean loss on the process that computed it, None on
        the others (the runtime shares it with every process)."""
        raise NotImplementedError(f"{self.name} trains with model(x) and rt.backward")

    def wrap_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return loss_fn

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Skip gradient synchronization (gradient accumulation's first micro-steps)."""
        return contextlib.nullcontext()

    def forward_state(self, model: nn.Module) -> Any:
        """What a forward of ``model`` changes in the strategy's wrapper, before it runs (see
        :meth:`forget_forward`)."""
        return None

    def forget_forward(self, model: nn.Module, state: Any) -> None:  # noqa: B027  (optional hook)
        """A forward ran whose backward never will (``--oom auto`` drops a piece on every
        process): put the wrapper back as :meth:`forward_state` found it, on every process
        alike, so that the next backward runs the same collectives everywhere."""

    def teardown(self) -> None:  # noqa: B027  (optional hook)
        """Leave the process group; safe to call twice."""

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name, "devices": [str(d) for d in self.devices]}


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
