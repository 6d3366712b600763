"""One process, several devices, the loss computed where the outputs are (seed 001).

PyTorch-Encoding's ``DataParallelModel`` + ``DataParallelCriterion``, done right. Each step
splits the inputs *and* the targets over the devices, runs the model and then the loss on
every device in threads (each re-entering the caller's autocast), and brings only the
per-device losses to the first device. That device therefore holds no outputs but its own
part, unlike ``nn.DataParallel``, which gathers every output there.

The user's loop does not change, ``loss = loss_fn(model(x), y)``, with the model and the
loss function both from ``rt.setup(model, optimizer, loss_fn)``. The model's outputs are a
:class:`PerDeviceOutputs`: one part per device, which the wrapped loss understands;
``outputs.gather()`` gives the ordinary output on the first device.

A model that computes its own loss (Hugging Face's ``model(input_ids, labels=labels).loss``)
needs no loss function: ``outputs.loss`` (or ``outputs["loss"]``) combines each device's loss
as below, and any other field (``outputs.logits``) is gathered on the first device.

The per-device losses are weighted by their number of samples, so the result is the mean
over the whole batch (a loss module with ``reduction="sum"`` is summed instead, and one with
``reduction="none"`` gives the per-sample losses in batch order). Losses that average over
something else than samples (class weights, ``ignore_index``) are weighted by samples too.

Devices may repeat (``cpu,cpu``, ``cuda:0,cuda:0``): replicas on one device share the very
same parameters, so gradients accumulate into them without a copy. Only distinct CUDA
devices get ``torch.nn.parallel.replicate`` copies.

BatchNorm, as under ``nn.DataParallel``: each device's part is normalized with its own
statistics, and the running statistics are updated from the first part only (the other
replicas, repeated devices included, update private copies that are dropped), so
``num_batches_tracked`` counts steps exactly as on one device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from paratrain.devices.precision import to_float32
from paratrain.strategies.base import Strategy, StrategyOptions
from paratrain.strategies.dp import resolve_parallel_devices
from paratrain.strategies.parallel_apply import (
    AUTOCAST_DEVICE_TYPES,
    GatherMeter,
    batch_size_of,
    gather,
    parallel_apply,
    replicas_for,
    scatter,
    split_sizes,
)
from paratrain.strategies.registry import register
from paratrain.utils.catalog import STRATEGIES
from paratrain.utils.errors import UserError


class PerDeviceOutputs:
    """A model's outputs under dp-balanced: one part per device, left where it was computed.

    Pass it to the loss function ``rt.setup`` returned. ``gather()`` gives the output an
    unwrapped model would have returned, on the first device (at the memory cost this
    strategy exists to avoid); ``parts``, ``devices`` and ``sizes`` describe the split.
    """

    def __init__(
        self,
        parts: list[Any],
        devices: list[torch.device],
        sizes: list[int],
        meter: GatherMeter,
    ) -> None:
        self.parts = parts
        self.devices = devices
        self.sizes = sizes
        self._meter = meter

    def __getattr__(self, name: str) -> Any:
        """A field of the model's output (``.loss``, ``.logits``): see :meth:`field`."""
        if name.startswith("_") or name in ("parts", "devices", "sizes"):
            raise AttributeError(name)
        return self.field(name)

    def __getitem__(self, key: str) -> Any:
        return self.field(key)

    def field(self, name: str) -> Any:
        """One field of every part's output (an attribute or a key: a ``ModelOutput``, a
        dataclass, a dict): a loss (one number per part) is their mean weighted by each
        part's samples, on the first device; anything else is joined along the batch
        dimension there, as :meth:`gather` does."""
        values = [_field(part, name) for part in self.parts]
        if all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in values):
            moved = torch.stack([v.to(self.devices[0]) for v in values])
            dtype = torch.promote_types(moved.dtype, torch.float32)
            weights = torch.tensor(self.sizes, dtype=dtype, device=self.devices[0])
            return ((moved.to(dtype) * weights).sum() / sum(self.sizes)).to(moved.dtype)
        if len(values) == 1:
            return values[0]
        result = gather(values, self.devices[0])
        self._meter.add(result)
        return result

    def gather(self) -> Any:
        """All parts joined along the batch dimension on the first device."""
        if len(self.parts) == 1:
            return self.parts[0]
        result = gather(self.parts, self.devices[0])
        self._meter.add(result)
        return result

    def __repr__(self) -> str:
        where = ", ".join(
            f"{size} on {device}" for size, device in zip(self.sizes, self.devices, strict=True)
        )
        return f"PerDeviceOutputs({where})"


def _field(output: Any, name: str) -> Any:
    if isinstance(output, dict) and name in output:  # dict, ModelOutput
        return output[name]
    if hasattr(output, name):
        return getattr(output, name)
    raise AttributeError(
        f"the model's output ({type(output).__name__}) has no field {name!r} under "
        "dp-balanced; compute the loss with the loss function rt.setup(model, optimizer, "
        "loss_fn) returned, or use outputs.gather() for the whole output"
    )


class BalancedDataParallel(nn.DataParallel[nn.Module]):
    """The model wrapper of dp-balanced; its forward returns :class:`PerDeviceOutputs`.

    It subclasses ``nn.DataParallel`` so that code which unwraps ``.module`` from a
    DataParallel (saving, evaluation) treats it the same; it shares none of its machinery.
    """

    def __init__(
        self, module: nn.Module, devices: Sequence[torch.device], meter: GatherMeter
    ) -> None:
        nn.Module.__init__(self)  # DataParallel's own __init__ takes CUDA device indices only
        self.module = module
        self.devices = list(devices)
        self.dim = 0
        self.device_ids = [d.index for d in devices if d.type == "cuda" and d.index is not None]
        first = devices[0]
        self.output_device = -1 if first.index is None else first.index  # -1: CPU, as in torch
        self.src_device_obj = devices[0]
        self.meter = meter

    def forward(self, *inputs: Any, **kwargs: Any) -> PerDeviceOutputs:
        self.meter.reset()
        rows = batch_size_of((inputs, kwargs))
        if not rows:
            raise UserError(
                "dp-balanced splits the batch along dimension 0 of the model's inputs, but "
                "the forward got no tensor with at least one row"
            )
        count = min(len(self.devices), rows)  # a short last batch uses fewer devices
        devices, sizes = self.devices[:count], split_sizes(rows, count)
        args = scatter(inputs, sizes, devices)
        kwargs_parts = scatter(kwargs, sizes, devices)
        modules = replicas_for(self.module, devices)
        parts = parallel_apply(modules, args, kwargs_parts, devices)
        if any(torch.is_autocast_enabled(kind) for kind in AUTOCAST_DEVICE_TYPES):
            # Outputs leave the autocast region as float32, as with every other strategy.
            parts = [to_float32(part) for part in parts]
        return PerDeviceOutputs(parts, devices, sizes, self.meter)


class BalancedCriterion(nn.Module):
    """The loss function of dp-balanced: computes each part's loss on that part's device.

    Called with :class:`PerDeviceOutputs`, it splits the targets (and keyword arguments) like
    the inputs, runs ``loss_fn`` on every device in threads and returns the batch's loss on
    the first device. Called with anything else it is ``loss_fn`` itself.
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor], meter: GatherMeter) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.meter = meter

    def forward(self, outputs: Any, *targets: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(outputs, PerDeviceOutputs):
            return self.loss_fn(outputs, *targets, **kwargs)
        devices, sizes = outputs.devices, outputs.sizes
        target_parts = scatter(targets, sizes, devices)
        kwargs_parts = scatter(kwargs, sizes, devices)
        args = [(part, *rest) for part, rest in zip(outputs.parts, target_parts, strict=True)]
        losses = parallel_apply(self._loss_fns(devices), args, kwargs_parts, devices)
        return self._combine(losses, sizes, devices[0])

    def _loss_fns(self, devices: list[torch.device]) -> list[Callable[..., Any]]:
        fn = self.loss_fn
        if isinstance(fn, nn.Module) and len(set(devices)) > 1:
            has_state = any(True for _ in fn.parameters()) or any(True for _ in fn.buffers())
            if has_state:  # e.g. class weights: each device needs its own copy
                return list(replicas_for(fn, devices))
        return [fn for _ in devices]

    def _combine(self, losses: list[Any], sizes: list[int], root: torch.device) -> torch.Tensor:
        for loss in losses:
            if not isinstance(loss, torch.Tensor):
                raise UserError(
                    f"under dp-balanced the loss function must return a tensor, got "
                    f"{type(loss).__name__}"
                )
        if len(losses) == 1:
            return losses[0]
        moved = [loss.to(root) for loss in losses]
        self.meter.add(moved)
        if any(loss.dim() > 0 for loss in moved):  # reduction="none": per-sample losses
            return torch.cat(moved)
        stacked = torch.stack(moved)
        if getattr(self.loss_fn, "reduction", "mean") == "sum":
            return stacked.sum()
        # Mean over uneven parts: sum_i n_i * loss_i / N, computed in at least float32.
        dtype = torch.promote_types(stacked.dtype, torch.float32)
        weights = torch.tensor(sizes, dtype=dtype, device=root) / sum(sizes)
        return (stacked.to(dtype) * weights).sum().to(stacked.dtype)


@register
class BalancedDataParallelStrategy(Strategy):
    name = "dp-balanced"
    allows_activation_checkpointing = False
    description = STRATEGIES["dp-balanced"]
    needs_loss_fn = True

    def compile_refused(self) -> str | None:
        return (
            f"--compile does not work with --strategy {self.name}: it runs the model in "
            "threads, which torch.compile does not support; use --strategy ddp (or cuda, "
            "cpu), or drop --compile"
        )

    def __init__(self, devices: list[torch.device], options: StrategyOptions | None = None) -> None:
        super().__init__(devices, options)
        self.meter = GatherMeter()

    @classmethod
    def resolve_devices(cls, spec: str | None) -> list[torch.device]:
        return resolve_parallel_devices(cls.name, spec, allow_cpu=True)

    def setup_process(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return BalancedDataParallel(model, self.devices, self.meter)

    def wrap_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if isinstance(loss_fn, nn.Module):
            loss_fn.to(self.root_device)  # replicated from the first device, like the model
        return BalancedCriterion(loss_fn, self.meter)

    def gathered_bytes_per_step(self) -> int:
        """Bytes brought to the first device since the last forward pass began: the
        per-device losses (plus the outputs, if ``PerDeviceOutputs.gather`` was called)."""
        return self.meter.bytes
