"""One training step traced for memory without allocating it: the model, a batch and the
optimizer live under ``FakeTensorMode`` (shapes and dtypes, no storage) and torch's
``MemTracker`` counts every tensor the step creates, by kind, at the step's peak.

The same tracker over real tensors (``fake=False``) is how the prediction is checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.strategies.blocks import choose_blocks
from paratrain.utils.errors import UserError
from paratrain.utils.tensor_bytes import tensor_bytes

#: the kinds of memory a device holds at its peak, in the order they are shown
KINDS = ("parameters", "gradients", "optimizer", "activations", "other")

#: a batch of ``n`` samples: ``(inputs, targets)``
Sampler = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
#: builds what one traced step needs, in whichever tensor mode is current:
#: ``(model, loss_fn, optimizer factory, sampler)``
Builder = Callable[
    [],
    tuple[nn.Module, Callable[..., torch.Tensor], Callable[[Iterator[nn.Parameter]], Any], Sampler],
]


@dataclass(frozen=True)
class Breakdown:
    """Bytes of each kind at one device's peak."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return sum(self.as_dict().values())

    def as_dict(self) -> dict[str, int]:
        return {kind: int(getattr(self, kind)) for kind in KINDS}

    def plus(self, **more: float) -> Breakdown:
        values = self.as_dict()
        for kind, value in more.items():
            values[kind] += int(value)
        return Breakdown(**values)

    def scaled(self, **factors: float) -> Breakdown:
        values = self.as_dict()
        for kind, factor in factors.items():
            values[kind] = int(values[kind] * factor)
        return Breakdown(**values)


@dataclass(frozen=True)
class StepTrace:
    """A traced step: the peak's breakdown, and sizes the layouts need."""

    batch: int
    peak: Breakdown
    #: bytes of the model's output for the whole batch (DataParallel gathers it)
    output_bytes: int
    #: bytes of all parameters, of the largest block's (fsdp's and pipeline's blocks),
    #: and of those in no block (fsdp's root keeps them gathered)
    parameter_bytes: int
    largest_block_bytes: int = 0
    unblocked_bytes: int = 0
    #: bytes of the parameters of each pipeline stage, first to last, as ``--strategy
    #: pipeline`` cuts the model for the ``stages`` asked (empty: not asked, or not cut)
    stage_parameter_bytes: tuple[int, ...] = ()
    #: bytes of the outputs of the modules in each of those stages in one forward: where
    #: the activations sit (a stage of convolutions holds more than one large linear layer)
    stage_activation_bytes: tuple[int, ...] = ()
    #: why ``--strategy pipeline`` cannot cut the model (empty: it can, or was not asked)
    stage_refusal: str = ""


def trace_step(
    build: Builder,
    batch: int,
    fake: bool = True,
    precision: str = "32",
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    stages: int = 0,
) -> StepTrace:
    """Trace a training step of ``batch`` samples (the second one, which holds the optimizer's
    state, as every later step does) under ``precision``'s autocast (bf16, fp16); ``wrap``
    changes the model before tracing (activation checkpointing); ``stages`` > 1: also how
    the pipeline's default cut into that many stages shares the parameters and the
    activations."""
    return trace_cuts(build, batch, fake, precision, wrap, (stages,))[stages]


def trace_cuts(
    build: Builder,
    batch: int,
    fake: bool = True,
    precision: str = "32",
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    cuts: tuple[int, ...] = (0,),
) -> dict[int, StepTrace]:
    """:func:`trace_step` once for several pipeline cuts (``{stages: trace}``): the step is
    the same, only the stages' shares differ (a plan on 4 devices reads cuts into 4 and 2)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    mode: contextlib.AbstractContextManager[Any] = (
        FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    )
    built = _build(build, mode) if isinstance(mode, FakeTensorMode) else build()
    with mode:
        model, loss_fn, make_optimizer, sample = built
        if wrap is not None:
            model = wrap(model)
        optimizer = make_optimizer(model.parameters())
        inputs, targets = sample(batch)
        staged = {n: _stage_modules(model, n) if n > 1 else ([], "") for n in cuts}
        produced, hooks = _count_outputs(model)
        # The first step, untracked: it creates the optimizer's state, which the tracker
        # then finds with the parameters. The second holds all the first held and more:
        # the peak is in it, traced at half the cost of tracing both.
        output_bytes = _step(model, loss_fn, optimizer, inputs, targets, precision, hooks)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            _step(model, loss_fn, optimizer, inputs, targets, precision, [])
        snapshot = tracker.get_tracker_snapshot("peak")
        blocks = [_bytes(block) for block in choose_blocks(model)]
        parameter_bytes = _bytes(model)
        shares = {
            n: _stage_shares(stage_modules, produced) for n, (stage_modules, _) in staged.items()
        }
    step_trace = StepTrace(
        batch,
        _breakdown(snapshot),
        output_bytes,
        parameter_bytes,
        max(blocks, default=0),
        parameter_bytes - sum(blocks),
    )
    return {
        n: dataclasses.replace(
            step_trace,
            stage_parameter_bytes=shares[n][0],
            stage_activation_bytes=shares[n][1],
            stage_refusal=staged[n][1],
        )
        for n in cuts
    }


def _step(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: Any,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    precision: str,
    hooks: list[Any],
) -> int:
    """One training step; ``hooks`` are removed after its forward (the counts of one forward,
    not of a recomputed one). Returns the bytes of the model's output."""
    with _autocast(precision):
        output = model(inputs)
        for hook in hooks:
            hook.remove()
        output_bytes = tensor_bytes(output)
        loss = loss_fn(output, targets)
    loss.backward()
    del output
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return output_bytes


def _stage_shares(
    stage_modules: list[nn.Module], produced: dict[int, int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each stage's parameter bytes, and the bytes its modules' outputs take in a forward."""
    parameters = tuple(_bytes(stage) for stage in stage_modules)
    outputs = tuple(sum(produced.get(id(m), 0) for m in stage.modules()) for stage in stage_modules)
    return parameters, outputs


def totals_tracker(model: nn.Module, optimizer: Any) -> Any:
    """A ``MemTracker`` of ``model`` and ``optimizer`` that keeps the totals by kind and no
    per-module figures: its module hooks break pipelining's ``autograd.grad``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    tracker._mod_tracker = _NoModules()  # type: ignore[assignment]
    return tracker


class _NoModules:
    """MemTracker's module tracker without its hooks."""

    parents: frozenset[str] = frozenset()
    is_bw = False

    def get_known_fqn(self, module: nn.Module) -> None:
        return None

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: object) -> None:
        pass


def _build(build: Builder, mode: Any) -> Any:
    """``build()`` under ``mode`` (fake tensors). A constructor that reads a number it
    computes (timm's stochastic depth rates: ``torch.linspace(...).item()``) cannot run on
    fake tensors: the model is then built on real ones and traced through fakes of its
    parameters and buffers (tied ones stay one)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    try:
        with mode:
            return build()
    except DataDependentOutputException:
        built = build()
    fakes: dict[int, Any] = {}
    for module in built[0].modules():
        for name, parameter in module._parameters.items():
            if parameter is not None and id(parameter) not in fakes:
                fake = mode.from_tensor(parameter.detach())
                fakes[id(parameter)] = nn.Parameter(fake, parameter.requires_grad)
            if parameter is not None:
                module._parameters[name] = fakes[id(parameter)]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = mode.from_tensor(buffer)
    return built


def _stage_modules(model: nn.Module, stages: int) -> tuple[list[nn.Module], str]:
    """The pipeline's stages of ``model``, or why it cannot cut it."""
    from paratrain.strategies.base import StrategyOptions
    from paratrain.strategies.pipeline_plan import batchnorm_refusal, plan_stages

    refused = batchnorm_refusal(model, StrategyOptions().pipeline_microbatches)
    if refused is not None:
        return [], refused
    try:
        return plan_stages(model, stages), ""
    except UserError as refused:  # the plan has no pipeline row, and says why
        return [], str(refused)


def _count_outputs(model: nn.Module) -> tuple[dict[int, int], list[Any]]:
    """Bytes each leaf module's outputs take in a forward (by the module's id), counted by
    forward hooks that the caller removes after one forward."""
    produced: dict[int, int] = {}

    def count(module: nn.Module, _: Any, output: Any) -> None:
        leaves = torch.utils._pytree.tree_leaves(output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        size = sum(t.numel() * t.element_size() for t in tensors)
        produced[id(module)] = produced.get(id(module), 0) + size

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    return produced, [m.register_forward_hook(count) for m in leaves]


def _autocast(precision: str) -> contextlib.AbstractContextManager[Any]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _breakdown(snapshot: dict[Any, dict[Any, int]]) -> Breakdown:
    """MemTracker's peak of the busiest device, in paratrain's kinds."""
    devices = [counts for counts in snapshot.values() if counts.get("Total", 0) > 0]
    if not devices:
        return Breakdown()
    counts = max(devices, key=lambda c: c.get("Total", 0))
    named = {getattr(key, "name", key): value for key, value in counts.items()}
    return Breakdown(
        parameters=named.get("PARAM", 0) + named.get("BUFFER", 0),
        gradients=named.get("GRAD", 0),
        optimizer=named.get("OPT", 0),
        activations=named.get("ACT", 0),
        other=named.get("TEMP", 0) + named.get("OTH", 0),
    )
