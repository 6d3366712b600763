"""One process's stage of a model split into a pipeline (``--strategy pipeline``).

Training runs the whole pipeline, forward and backward of every micro-batch, in one
:meth:`PipelinedModel.train_step` (torch.distributed.pipelining's GPipe or 1F1B schedule):
the first stage feeds the inputs, the last computes the loss. Forward-only calls
(``model(x)`` under ``torch.no_grad()``, evaluation) pass activations stage to stage and
give every process the last stage's output, so evaluation code runs unchanged.

The stage's modules are this module's own children under the full model's names, so its
``state_dict`` holds the model's names for the part it holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from paratrain.utils.errors import UserError

SCHEDULES = ("1f1b", "gpipe")
#: what a PipelineStage of a torch that restores the buffers after its shape run has
_TORCH_KEEPS_BUFFERS = "_pre_metadata_inference_backup"

LossFn = Callable[..., torch.Tensor]


class PipelinedModel(nn.Module):
    """Stage ``index`` of ``count``; its process's rank is ``first_rank + index`` (the
    pipeline's first stage's rank: 0, or a copy's under ``--replicate``), ``stage_group``
    the pipeline's processes (None: every process of the run)."""

    #: a part of the model: checkpoints gather the parts, ``load_weights`` loads its part
    holds_part_of_model = True
    #: the traced stage (its modules are registered as this module's own children)
    stage: nn.Module

    def __init__(
        self,
        stage: nn.Module,
        index: int,
        count: int,
        device: torch.device,
        full_shapes: dict[str, tuple[int, ...]],
        schedule: str = "1f1b",
        microbatches: int = 4,
        autocast_dtype: torch.dtype | None = None,
        tied: Sequence[nn.Parameter] = (),
        tie_group: Any = None,
        stage_group: Any = None,
        first_rank: int = 0,
    ) -> None:
        super().__init__()
        for name, child in stage.named_children():
            self.add_module(name, child)
        for name, param in stage.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in stage.named_buffers(recurse=False):
            self.register_buffer(name, buffer)
        object.__setattr__(self, "stage", stage)  # not a child: its modules are ours already
        self.index, self.count, self.device = index, count, device
        self.schedule_name, self.microbatches = schedule, microbatches
        self.autocast_dtype = autocast_dtype
        self._full_shapes = full_shapes
        self._schedules: dict[tuple[int, int], Any] = {}
        self._stepped: set[Any] = set()  # schedules that took a step (learned their shapes)
        self._loss_fn: LossFn | None = None
        self._weight = 1.0
        #: the whole batch's label count, for a model's own loss (loss_fn None)
        self._items = 0
        #: parameters the first and the last stage both hold (a head tied to the embedding),
        #: and the group of those two stages that sums their gradients
        self._tied, self._tie_group = list(tied), tie_group
        self._group, self._first = stage_group, first_rank

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def full_state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The whole model's state dict shapes (this stage holds a part of them)."""
        return dict(self._full_shapes)

    # -- training ----------------------------------------------------------------------------
    def train_step(
        self,
        inputs: torch.Tensor,
        target: torch.Tensor,
        loss_fn: LossFn | None,
        scale: float = 1.0,
    ) -> torch.Tensor | None:
        """Forward and backward of one batch through every stage, in micro-batches. Returns
        the batch's mean loss on the last stage, None on the others: the runtime shares it
        in the step's one small all-reduce (:mod:`paratrain.runtime.agreement`). Gradients
        are those of ``scale`` x the batch's mean loss, whatever the micro-batch sizes.
        ``loss_fn`` None: the model's own loss from ``labels=target`` (a Hugging Face
        decoder's, labels shifted inside)."""
        rows = int(inputs.shape[0])
        micro = _micro_batches(rows, self.microbatches)
        schedule = self._schedule(rows, micro)
        self._loss_fn, self._weight = loss_fn, scale / rows
        if loss_fn is None:  # the model's own loss: labels counted over the whole batch
            self._items, self._weight = self._count_labels(target), scale
        losses: list[torch.Tensor] = []  # the micro-batches' weighted losses
        before = [p.grad for p in self._tied]
        with self._autocast(), self._buffers_kept_from_shape_run(schedule):
            if self.is_first:
                # a stage checks its micro-batches' strides against a contiguous batch's
                # (torch 2.11): a slice such as tokens[:, :-1] is copied first
                schedule.step(inputs.contiguous())
            elif self.is_last:
                schedule.step(target=target, losses=losses)
            else:
                schedule.step()
        self._sum_tied_gradients(before)
        if not self.is_last:
            return None
        mine = torch.zeros((), dtype=torch.float32, device=self.device)
        if scale:
            mine += torch.stack(losses).detach().sum().float() / scale
        return mine

    def _schedule(self, rows: int, micro: int) -> Any:
        """One schedule per batch and micro-batch size: a stage learns the shapes it sends
        and receives on its first step."""
        key = (rows, micro)
        if key not in self._schedules:
            # imported here: torch.distributed.pipelining loads torch._dynamo (a second)
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            stage = PipelineStage(
                self.stage, self.index, self.count, self.device, group=self._group
            )
            one_f_one_b = self.schedule_name == "1f1b" and micro >= self.count
            kind = Schedule1F1B if one_f_one_b else ScheduleGPipe
            # scale_grads=False: the loss below is already weighted by micro-batch size
            self._schedules[key] = kind(
                stage, micro, loss_fn=self._weighted_loss, scale_grads=False
            )
        return self._schedules[key]

    @contextlib.contextmanager
    def _buffers_kept_from_shape_run(self, schedule: Any) -> Iterator[None]:
        """A new schedule's first step: torch before 2.14 first runs the stage once more, in
        training mode, to learn the shapes it sends (on zeros or on the batch), and that run
        counted in BatchNorm's running statistics and ``num_batches_tracked``. The buffers
        are put back as they were before the first micro-batch's run (torch 2.14 does so
        itself)."""
        if schedule in self._stepped or hasattr(schedule_stage_class(), _TORCH_KEEPS_BUFFERS):
            yield
            return
        self._stepped.add(schedule)
        kept = [(buffer, buffer.detach().clone()) for buffer in self.stage.buffers()]
        calls = 0

        def put_back(*_: Any) -> None:
            # before the second run: the first micro-batch's (the shape run's backward,
            # torch 2.13's, has used the buffers it saved by then)
            nonlocal calls
            calls += 1
            if calls == 2:
                handle.remove()
                with torch.no_grad():
                    for buffer, value in kept:
                        buffer.copy_(value)

        handle = self.stage.register_forward_pre_hook(put_back)
        try:
            yield
        finally:
            handle.remove()

    def _weighted_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean loss weighted by its share of the batch: the micro-batches'
        gradients add up to the batch mean's."""
        if self._loss_fn is None:  # already a share of the whole batch's labels
            own: torch.Tensor = cast(Any, self.stage).own_loss(output, target, self._items)
            return own * self._weight
        loss = self._loss_fn(self._present(output), target)
        return loss * (int(target.shape[0]) * self._weight)

    def _count_labels(self, target: torch.Tensor) -> int:
        count = getattr(self.stage, "label_count", None)
        if count is None:
            raise UserError(
                "rt.forward_backward(model, None, x, y) trains on the model's own loss, and "
                "under --strategy pipeline only a Hugging Face decoder computes one; pass a "
                "loss function"
            )
        return int(count(target))

    def _present(self, output: Any) -> Any:
        """The last stage's output as the user's code sees it (a Hugging Face decoder's
        ``.logits`` in a ``ModelOutput``)."""
        present = getattr(self.stage, "present", None)
        return output if present is None else present(output)

    def _sum_tied_gradients(self, before: Sequence[torch.Tensor | None]) -> None:
        """A tied parameter's gradient is the sum of the first stage's and the last's: each
        adds the other's part of this step (``before``: what it held, under accumulation)."""
        for param, held in zip(self._tied, before, strict=True):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            step = grad if held is None else grad - held
            dist.all_reduce(step, group=self._tie_group)
            param.grad = step if held is None else held + step

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # -- forward only ------------------------------------------------------------------------
    def forward(self, *inputs: torch.Tensor, **options: Any) -> Any:
        self._check_options(options)
        if torch.is_grad_enabled() and self.training:
            raise UserError(
                "--strategy pipeline trains forward and backward together: use "
                "loss = rt.forward_backward(model, loss_fn, x, y) instead of model(x) and "
                "rt.backward(loss); under torch.no_grad() model(x) runs the pipeline forward"
            )
        with self._autocast():
            rank = self._first + self.index
            values: Sequence[torch.Tensor] = (
                inputs if self.is_first else _receive(rank - 1, self.device)
            )
            output = self.stage(*values)
        last = self._first + self.count - 1
        if not self.is_last:
            _send(output if isinstance(output, tuple) else (output,), rank + 1)
            output = _broadcast_output(None, last, self.device, self._group)
        else:
            output = _broadcast_output(output, last, self.device, self._group)
        labels = options.get("labels")
        if labels is None:
            return self._present(output)
        presented = self._present(output)  # a decoder's own loss, on every process
        presented.loss = cast(Any, self.stage).own_loss(output, labels, self._count_labels(labels))
        return presented

    def _check_options(self, options: dict[str, Any]) -> None:
        """Keyword arguments of the model's forward: only what the stage can take."""
        if not options:
            return
        refused = getattr(self.stage, "options_refused", None)
        why = (
            f"{', '.join(sorted(options))}: a stage takes its inputs positionally"
            if refused is None
            else refused(options)
        )
        if why is not None:
            raise UserError(f"--strategy pipeline cannot pass the model {why}")


def _micro_batches(rows: int, wanted: int) -> int:
    """The most micro-batches, at most ``wanted``, that split ``rows`` evenly: every
    micro-batch of a step has one shape (the last, smaller batch of an epoch takes fewer)."""
    return max(count for count in range(1, min(wanted, rows) + 1) if rows % count == 0)


def _send(tensors: Sequence[torch.Tensor], dst: int) -> None:
    meta = [(tuple(t.shape), t.dtype) for t in tensors]
    dist.send_object_list([meta], dst=dst)
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=dst)


def _receive(src: int, device: torch.device) -> list[torch.Tensor]:
    holder: list[Any] = [None]
    dist.recv_object_list(holder, src=src)
    received = []
    for shape, dtype in holder[0]:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=src)
        received.append(tensor)
    return received


def _broadcast_output(output: Any, src: int, device: torch.device, group: Any = None) -> Any:
    """The last stage's output (a tensor or a tuple of tensors) on every process of
    ``group`` (``src``: a rank of the run)."""
    single = isinstance(output, torch.Tensor)
    tensors = [t.contiguous() for t in ([output] if single else list(output or ()))]
    holder: list[Any] = [[(tuple(t.shape), t.dtype) for t in tensors], single]
    dist.broadcast_object_list(holder, src=src, group=group)
    meta, single = holder
    if output is None:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in meta]
    for tensor in tensors:
        dist.broadcast(tensor, src=src, group=group)
    return tensors[0] if single else tuple(tensors)


def schedule_stage_class() -> type:
    """torch's PipelineStage (imported when used: the module loads torch._dynamo)."""
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage
