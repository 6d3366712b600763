"""The step pipeline: every way a training step is taken goes through the same stages.

``paratrain train``, ``rt.backward(loss)``, ``rt.forward_backward(model, loss_fn, x, y)``,
accumulation and the pipeline schedule all run one micro-batch as:

1. **begin**: the micro-batch's loss weight and place in its accumulation group, taken
   from the batch itself (:mod:`paratrain.runtime.step_state`); inside ``rt.accumulate``
   the gradient synchronisation is skipped here for all but a group's last micro-batch;
2. **forward** and **loss** (the user's, for ``rt.backward``; the pipeline's schedule runs
   forward and backward together);
3. **look**: this process's view of the loss (the non-finite check; fault injection);
4. **agreement**: the step's one small all-reduce: a non-finite loss, running out of
   memory, a stop signal, the pipeline's loss (:mod:`paratrain.runtime.agreement`);
5. **backward** through the precision policy, scaled for accumulation and uneven batches,
   then the compile check on the first step (:mod:`paratrain.runtime.compile_check`);
6. **done**: the state advances (the micro-batch count, the optimizer-step count).

The optimizer step is the sixth stage's consequence: ``optimizer.step()`` applies the
gradients only when the group is complete (:mod:`paratrain.runtime.optim`).

``--oom auto`` is a retry around stages 2–5 (:mod:`paratrain.runtime.oom`): a micro-batch is
cut into pieces, and a piece that ran out of memory on any process is dropped everywhere and
redone in halves. No path can skip a stage, so a check added to one is on all of them.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.data.loaders import BatchInfo, batch_info
from paratrain.launching import faults, heartbeat
from paratrain.runtime.agreement import Verdict
from paratrain.runtime.determinism import naming_nondeterministic
from paratrain.runtime.nonfinite import Look
from paratrain.runtime.oom import OutOfMemoryStop, Snapshot, batch_length, cut, test_hook
from paratrain.runtime.parts import RuntimeParts
from paratrain.utils.errors import PlacementError, UserError


class TrainingStep:
    """One micro-batch's stages, as every strategy and every entry point runs them."""

    def __init__(self, rt: RuntimeParts) -> None:
        self.rt = rt
        #: inside ``rt.accumulate(model)``: the model and what skips its gradient sync
        self._deferred: tuple[nn.Module, contextlib.ExitStack] | None = None
        #: inside rt.forward_backward's pieces: an out-of-memory error is redone there
        self._in_pieces = False

    # -- stage 1: begin ----------------------------------------------------------------------
    def begin(self, info: BatchInfo | None) -> None:
        """A forward of the model (or ``rt.forward_backward``) with inputs carrying ``info``:
        the first of a micro-batch begins it."""
        state = self.rt.state
        if not state.begin(info) or self._deferred is None:
            return
        model, skipped = self._deferred
        if not state.ends_group:  # rt.accumulate: no gradient sync before the group's end
            skipped.enter_context(self.rt.strategy.no_sync(model))

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module) -> Any:
        """``rt.accumulate``: whether this micro-batch syncs is decided when it begins, from
        the batch itself (the loop may hold batches taken ahead)."""
        with contextlib.ExitStack() as skipped:
            self._deferred = (model, skipped)
            try:
                if self.rt.state.begun and not self.rt.state.ends_group:
                    skipped.enter_context(self.rt.strategy.no_sync(model))
                yield
            finally:
                self._deferred = None

    def forward_failed(self, exc: torch.OutOfMemoryError) -> None:
        """The model's forward ran out of memory in the user's own code: ``--oom auto``
        can only redo what ``rt.forward_backward`` runs; said in one line."""
        if self._in_pieces or not self.rt.micro_batches.active:
            return
        raise OutOfMemoryStop(
            f"rank {self.rt.strategy.collective.rank} ran out of memory in the model's forward "
            f"at step {self.rt.state.step + 1}: --oom auto redoes a micro-batch only inside "
            "rt.forward_backward(model, loss_fn, x, y); use it instead of model(x) and "
            "rt.backward(loss)"
        ) from exc

    # -- the entry points --------------------------------------------------------------------
    def forward_backward(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor] | None,
        inputs: Any,
        target: Any,
    ) -> torch.Tensor:
        rt = self.rt
        self.begin(batch_info(inputs, target))
        if rt.strategy.trains_in_pipeline:
            with rt.strategy.collective.operation("rt.forward_backward"):
                return self._pipeline_step(model, loss_fn, inputs, target)
        if loss_fn is None:  # the model's own loss (Hugging Face's labels=...: .loss)
            if rt.micro_batches.active:
                raise UserError(
                    "--oom auto cuts a batch and needs the loss function: "
                    "rt.forward_backward(model, loss_fn, x, y), not the model's own loss"
                )
            loss: torch.Tensor = model(inputs, labels=target).loss
            self.backward(loss)
            return loss
        if rt.micro_batches.active:
            self._in_pieces = True
            try:
                return self._in_pieces_step(model, loss_fn, inputs, target)
            finally:
                self._in_pieces = False
        loss = loss_fn(model(inputs), target)
        self.backward(loss)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        strategy = self.rt.strategy
        if strategy.trains_in_pipeline:
            raise UserError(
                f"--strategy {strategy.name} runs forward and backward together: use "
                "loss = rt.forward_backward(model, loss_fn, x, y) instead of rt.backward(loss)"
            )
        if loss.dim() != 0:
            raise PlacementError("rt.backward expects a scalar loss tensor")
        # stages 3 to 6 of a micro-batch whose loss is given
        rt = self.rt
        state, micro_batches = rt.state, rt.micro_batches
        if not state.begun:  # no forward seen (a loss made without the model): the oldest batch
            self.begin(None)
        step = state.step + 1
        loss = faults.at_step(strategy.collective.rank, step, loss)
        # quiet: nothing must be decided before the backward, the agreement is read later (a
        # non-finite loss stops the run at the next point that reads it, one step late at
        # most, and before any checkpoint or the final weights are written)
        quiet = rt.nonfinite.policy == "error" and not micro_batches.active and not state.local_only
        # the step's collectives (the gradient all-reduce): waits on the other ranks
        with strategy.collective.operation("rt.backward"), heartbeat.waiting():
            if quiet:
                admitted = self._send(loss, step)
            else:
                look = self._look(loss, step)
                # nothing to agree on (one process, a finite loss; the check off): none
                verdict = Verdict() if look.bad is None else self._agree(step, look.bad)
                admitted = self._settle(look, verdict)
            if admitted:
                scale = state.loss_scale
                try:
                    self._backward(loss * scale if scale != 1.0 else loss)
                except torch.OutOfMemoryError as exc:
                    if not micro_batches.active:
                        raise
                    raise OutOfMemoryStop(
                        f"rank {strategy.collective.rank} ran out of memory in the "
                        f"backward pass of step {step}: --oom auto redoes a micro-batch only "
                        "inside rt.forward_backward(model, loss_fn, x, y); use it instead of "
                        "rt.backward(loss)"
                    ) from exc
        state.micro_batch_done()  # stage 6 (a skipped micro-batch too: on every rank alike)

    # -- stages 3 to 6 -----------------------------------------------------------------------
    def _send(self, loss: torch.Tensor, step: int) -> bool:
        """Stages 3 and 4 on the quiet path: the agreement is sent, not waited for."""
        rt = self.rt
        state, collective, nonfinite = rt.state, rt.strategy.collective, rt.nonfinite
        agreement = state.agreement
        if agreement.waiting:
            # the previous micro-batch's agreement, started a forward ago (a micro-batch
            # inside an accumulation group sends none: it is read here, not a group later)
            agreement.settle(collective)
        # one process on the CPU: nothing to wait for, so each micro-batch is judged at once
        at_once = collective.world_size == 1 and loss.is_cpu
        agrees = at_once or (state.ends_group and self._due(step))
        look = nonfinite.look(loss, collective, step, agrees, deferred=True)
        nonfinite.sent(look)
        state.skipped = False
        if look.bad is not None:
            agreement.send(
                collective, step, look.bad, functools.partial(nonfinite.judge, look, collective)
            )
            if at_once:  # a non-finite loss (the only one sent) raises here, before its backward
                agreement.settle(collective)
        return True

    def _due(self, step: int) -> bool:
        """Whether the quiet path agrees at this optimizer step. Batches of
        ``rt.setup_loader`` come in the same number on every process, so the processes
        agree at the main process's pace (``agreement_seconds``) and at each epoch's end;
        batches the loop made itself may run out on one process first, where the step's
        agreement names it: every step."""
        state = self.rt.state
        batch = state.batch
        if self.rt.strategy.collective.world_size == 1:
            return True  # nothing to wait for: one process agrees with itself
        return batch.source == 0 or batch.ends_epoch or state.agreement.due(step)

    def settle(self) -> None:
        """Read the step's agreements sent and not read yet (a non-finite loss raises
        here): before a checkpoint, the final weights, or a collective; at the pace of
        ``agreement_seconds``, the steps since the last agreement agree now (every process
        comes here at the same step)."""
        rt = self.rt
        state, collective = rt.state, rt.strategy.collective
        state.agreement.settle(collective)
        if rt.nonfinite.policy == "off" or not state.agreement.behind(state.step):
            return
        look = rt.nonfinite.pending(rt.strategy.root_device)
        here = f"checking the steps up to {state.step}"
        verdict = state.agreement.exchange(collective, state.step, here, bad=look.bad)
        rt.nonfinite.settle(look, collective, verdict.bad)

    def _look(self, loss: torch.Tensor, step: int, ends_step: bool | None = None) -> Look:
        rt = self.rt
        ends = rt.state.ends_group if ends_step is None else ends_step
        return rt.nonfinite.look(loss, rt.strategy.collective, step, ends, rt.state.local_only)

    def _agree(
        self,
        step: int,
        bad: torch.Tensor | None,
        failed: bool = False,
        samples: int = 0,
        value: torch.Tensor | None = None,
    ) -> Verdict:
        """The step's one small all-reduce (every process runs it at the same point)."""
        rt = self.rt
        return rt.state.agreement.exchange(
            rt.strategy.collective,
            step,
            f"at training step {step}",
            bad=bad,
            failed=failed,
            samples=samples,
            value=value,
        )

    def _settle(self, look: Look, verdict: Verdict) -> bool:
        """Whether the micro-batch's gradients count (the non-finite policy's answer)."""
        admitted = self.rt.nonfinite.settle(look, self.rt.strategy.collective, verdict.bad)
        self.rt.state.skipped = not admitted
        return admitted

    def _backward(self, loss: torch.Tensor) -> None:
        rt = self.rt
        backward = rt.precision.backward
        if rt.config.deterministic:
            backward = naming_nondeterministic(backward)
        backward(loss)
        rt.speed.after_backward()  # --compile: the first step's gradients checked against eager

    # -- the pipeline's schedule: forward and backward together ------------------------------
    def _pipeline_step(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor] | None,
        inputs: Any,
        target: Any,
    ) -> torch.Tensor:
        rt = self.rt
        state, strategy = rt.state, rt.strategy
        step = state.step + 1
        with heartbeat.waiting():
            part = strategy.train_step(model, inputs, target, loss_fn, state.loss_scale)
            # the last stage has the loss; another judges its own part, nothing but a fault
            mine = part if part is not None else torch.zeros((), device=strategy.root_device)
            mine = faults.at_step(strategy.collective.rank, step, mine)
            look = self._look(mine, step)
            # the step's one small all-reduce brings the loss to every process as well
            bad = look.bad if look.bad is not None else ~torch.isfinite(mine)
            verdict = self._agree(step, bad, value=None if part is None else mine)
            value = math.nan if verdict.bad else verdict.value
            loss = torch.tensor(value, dtype=torch.float32, device=mine.device)
            # the gradients are there already: a skipped micro-batch's are dropped
            if not self._settle(look, verdict):
                model.zero_grad(set_to_none=True)
        state.micro_batch_done()
        return loss

    # -- --oom auto: a retry around stages 2 to 5 --------------------------------------------
    def _in_pieces_step(
        self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, target: Any
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch in pieces; returns its mean loss."""
        rt = self.rt
        state, strategy, micro_batches = rt.state, rt.strategy, rt.micro_batches
        collective, device = strategy.collective, strategy.root_device
        ends_step = state.ends_group
        first_of_step = state.micro_steps == 0
        step = state.step + 1
        length = batch_length(inputs)
        plan = _pieces(length, micro_batches.split)
        total = torch.zeros((), device=device)
        index = 0
        while index < len(plan):
            start, end = plan[index]
            last = index == len(plan) - 1
            syncs = ends_step and (last or strategy.pieces_sync_each)
            quiet = not syncs and ends_step  # otherwise rt.accumulate's no_sync holds
            share = (end - start) / length
            # an empty piece (fewer samples than pieces) still runs, weighted 0: every
            # process runs the same forwards and collectives
            cut_at = (start, end) if end > start else (0, 1)
            snapshot = Snapshot.take(model, device)
            forgotten = strategy.forward_state(model)
            with strategy.no_sync(model) if quiet else contextlib.nullcontext():
                loss, failed = self._piece_forward(model, loss_fn, inputs, target, cut_at, step)
                look = None
                if loss is not None:
                    loss = faults.at_step(collective.rank, step, loss)
                    look = self._look(loss, step, ends_step and last)
                # one all-reduce: out of memory anywhere, a non-finite loss, a stop
                with heartbeat.waiting():  # waits on the other processes: not a hang here
                    bad = None if look is None else look.bad
                    verdict = self._agree(step, bad, failed=failed, samples=end - start)
                redo = None
                if verdict.failed:
                    redo = (micro_batches.failed_ranks(collective, failed), verdict.samples)
                else:
                    assert look is not None and loss is not None  # no process failed
                    with heartbeat.waiting():
                        communicates = collective.world_size > 1 and (
                            syncs or strategy.collective_forward
                        )
                        weight = state.loss_scale * share
                        nothing_before = first_of_step and index == 0
                        if self._settle(look, verdict) and self._piece_backward(
                            model, loss * weight, communicates, nothing_before
                        ):
                            redo = ([collective.rank], end - start)
            if redo is not None:  # out of memory: every process redoes the piece
                loss = None
                snapshot.restore(device)
                strategy.forget_forward(model, forgotten)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                micro_batches.halve(collective, redo[0], redo[1], step)
                plan = plan[:index] + [half for p in plan[index:] for half in _halves(p)]
                continue
            assert loss is not None
            total += loss.detach().float() * share
            index += 1
        state.micro_batch_done()
        return total

    def _piece_forward(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        inputs: Any,
        target: Any,
        cut_at: tuple[int, int],
        step: int,
    ) -> tuple[torch.Tensor | None, bool]:
        strategy = self.rt.strategy
        collective = strategy.collective
        start, end = cut_at
        try:
            output = model(cut(inputs, start, end))
        except torch.OutOfMemoryError as exc:
            if collective.world_size > 1 and strategy.collective_forward:
                raise OutOfMemoryStop(
                    f"rank {collective.rank} ran out of memory inside --strategy "
                    f"{strategy.name}'s forward, between its parameter gathers, where the "
                    "other processes wait: it cannot be redone; use a smaller --batch-size or "
                    "--accumulate 2"
                ) from exc
            return None, True
        try:
            loss = loss_fn(output, cut(target, start, end))
            test_hook(collective.rank, end - start, step)
        except torch.OutOfMemoryError:
            return None, True
        return loss, False

    def _piece_backward(
        self, model: nn.Module, loss: torch.Tensor, communicates: bool, nothing_before: bool
    ) -> bool:
        """Run the backward; True if it ran out of memory and can be redone (one process,
        no gradient of the step there before it: they are dropped)."""
        collective = self.rt.strategy.collective
        try:
            self._backward(loss)
        except torch.OutOfMemoryError as exc:
            if communicates or not nothing_before or collective.world_size > 1:
                why = (
                    "the other processes wait in the backward's collectives"
                    if communicates or collective.world_size > 1
                    else "gradients of earlier pieces of the step were already summed"
                )
                raise OutOfMemoryStop(
                    f"rank {collective.rank} ran out of memory in the backward pass, where it "
                    f"cannot be redone ({why}); use a smaller --batch-size or --accumulate 2"
                ) from exc
            model.zero_grad(set_to_none=True)
            return True
        return False


def _pieces(length: int, split: int) -> list[tuple[int, int]]:
    """``split`` pieces of ``length`` samples, as even as can be."""
    base, extra = divmod(length, split)
    plan, start = [], 0
    for index in range(split):
        end = start + base + (1 if index < extra else 0)
        plan.append((start, end))
        start = end
    return plan


def _halves(piece: tuple[int, int]) -> list[tuple[int, int]]:
    start, end = piece
    middle = start + (end - start + 1) // 2
    return [(start, middle), (middle, end)]
