"""The training loop behind `paratrain train`, written only against the Runtime."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from paratrain.checkpoints.state import (
    CHECKPOINTS,
    Checkpointer,
    Position,
    ProcessLayout,
    TrainingParts,
    load_checkpoint,
)
from paratrain.checkpoints.state.store import checkpoint_name
from paratrain.checkpoints.weights import unwrap_model
from paratrain.data.loaders import DeviceLoader, batch_info
from paratrain.launching.threads import load_note
from paratrain.runtime.facade import Runtime
from paratrain.training import rundir
from paratrain.training.config import TrainConfig
from paratrain.training.loggers import build_observers
from paratrain.training.loop_timing import LoopClock, LoopTimes
from paratrain.training.observer import EpochReport, Observers, StepReport
from paratrain.training.recipes import get_recipe
from paratrain.training.watch import RunWatch
from paratrain.utils.errors import UserError


@dataclass
class Summary:
    epochs: int
    steps: int
    seconds: float
    train_loss: float
    eval_loss: float
    eval_accuracy: float | None
    samples_per_second: float
    times: LoopTimes = field(default_factory=LoopTimes)
    #: --oom auto: pieces per micro-batch at the end (1: never ran out of memory), the step
    #: it was last halved at and the samples per process of a piece then
    micro_batch_split: int = 1
    halved_at_step: int | None = None
    piece_samples: int | None = None
    #: the epochs as they were: optimizer steps / steps per epoch (1.1 for 50 steps of 45)
    epochs_trained: float | None = None

    def line(self, directory: Path | None) -> str:
        accuracy = "" if self.eval_accuracy is None else f", test accuracy {self.eval_accuracy:.2%}"
        where = "" if directory is None else f"; saved to {directory}"
        return (
            f"trained {epochs_text(self.epochs_trained, self.epochs)}, {self.steps} steps in "
            f"{self.seconds:.1f}s "
            f"({self.samples_per_second:,.0f} samples/s): train loss {self.train_loss:.4f}, "
            f"test loss {self.eval_loss:.4f}{accuracy}{self.times.line(self.seconds)}"
            f"{self._oom_line()}{where}"
        )

    def _oom_line(self) -> str:
        if self.halved_at_step is None:
            return ""
        return (
            f"; ran out of memory at step {self.halved_at_step}: micro-batches run in "
            f"{self.micro_batch_split} pieces of about {self.piece_samples} samples per process"
        )


def epochs_text(trained: float | None, started: int) -> str:
    """``2 epochs``, ``1 epoch``, ``1.1 epochs``, ``0.04 epochs``: what was trained, not the
    count of epochs begun (``started``, said where the fraction is unknown)."""
    if trained is None:
        return f"{started} epoch{'' if started == 1 else 's'}"
    if trained == int(trained):
        return f"{int(trained)} epoch{'' if trained == 1 else 's'}"
    return f"{trained:.1f} epochs" if trained >= 0.095 else f"{trained:.2g} epochs"


def evaluate(
    rt: Runtime, model: nn.Module, loader: DeviceLoader, loss_fn: nn.Module, classify: bool
) -> tuple[float, float | None]:
    """Loss and accuracy over the whole test set, each sample counted exactly once."""
    inner = unwrap_model(model)
    was_training = inner.training
    inner.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=rt.device)  # loss sum, correct, count
    batches, most, x = 0, 0, None
    if rt.strategy.collective_forward:  # before any forward: collectives run in one order
        most = int(rt.all_reduce(torch.tensor(float(len(loader)), device=rt.device), "max").item())
    with torch.no_grad(), rt.autocast():
        for x, y in loader:
            output = _scores(inner(x))
            totals[0] += loss_fn(output, y).double() * len(y)
            if classify:
                totals[1] += (output.argmax(dim=1) == y).sum()
            totals[2] += len(y)
            batches += 1
        # fsdp gathers parameters in every forward: a process whose part of the last batch
        # is empty runs a forward that counts nothing, so the others do not wait for it.
        if x is not None:
            for _ in range(most - batches):
                inner(x[:1])
    inner.train(was_training)
    totals = rt.all_reduce(totals, "sum").cpu()
    count = max(totals[2].item(), 1.0)
    return totals[0].item() / count, (totals[1].item() / count if classify else None)


def _scores(output: Any) -> torch.Tensor:
    """The model's scores in float32: its output, or the ``.logits`` of one that holds
    them (Hugging Face's)."""
    scores: torch.Tensor = getattr(output, "logits", output)
    return scores.float()


#: called on the main process after each epoch (see ``train``)
EpochCallback = Callable[[dict[str, Any]], None]


@dataclass
class LoopParts:
    """What the epochs train with, built once by ``_set_up``."""

    rt: Runtime
    cfg: TrainConfig
    model: nn.Module
    optimizer: Any
    scheduler: Any
    #: the loss as ``rt.setup`` returned it, and the recipe's own (evaluation, FLOPs)
    loss_fn: Any
    plain_loss: nn.Module
    classification: bool
    train_loader: DeviceLoader
    test_loader: DeviceLoader
    saver: Checkpointer
    watch: RunWatch
    observers: Observers
    #: optimizer steps this run trains up to (``--max-steps`` or the epochs')
    total: int
    steps_per_epoch: int
    on_epoch: EpochCallback | None
    #: the run's time starts after its set-up: ``time.perf_counter()`` then, and the clock
    start: float
    clock: LoopClock


@dataclass
class LoopState:
    """Where the run stands: ``batch`` global batches of ``epoch`` trained, ``step``
    optimizer steps in the whole run, ``samples`` (all processes) in this run; ``loss_sum``
    and ``count``: this process's in the epoch so far; the last finished epoch's figures."""

    epoch: int
    batch: int
    step: int
    samples: int = 0
    loss_sum: Any = 0.0
    count: int = 0
    train_loss: float = math.nan
    eval_loss: float = math.nan
    eval_accuracy: float | None = None


def train(
    rt: Runtime, cfg: TrainConfig, directory: Path | None, on_epoch: EpochCallback | None = None
) -> Summary:
    """Train ``cfg.recipe`` with ``rt``; the main process writes ``directory``'s files.

    Checkpoints go to ``directory/checkpoints``; ``cfg.resume_from`` continues from one.
    ``on_epoch`` (``paratrain tune`` reports to Ray Tune with it) is called on the main
    process after each epoch's evaluation and end-of-epoch checkpoint, with ``epoch``,
    ``step``, ``train_loss``, ``eval_loss`` and ``eval_accuracy`` (None for regression).
    """
    loop, at = _set_up(rt, cfg, directory, on_epoch)
    assert cfg.epochs is not None  # resolved: the recipe's where not given
    last = at.last_metrics  # a resumed run that trains no further still has its figures
    state = LoopState(at.epoch - 1, at.batch, at.step)
    state.train_loss = last.get("train_loss", math.nan)
    state.eval_loss = last.get("eval_loss", math.nan)
    state.eval_accuracy = last.get("eval_accuracy")
    if rt.world_size == 1 and (note := load_note(rt.threads, 1)) is not None:
        print(f"paratrain: note: {note}", file=sys.stderr, flush=True)  # launchers say theirs
    _count_steps_from(rt, at.step)  # steps are named by their number in the whole run
    if _stop_asked(rt):  # from here on a signal stops after a step (and before the first)
        _stop(loop, (at.epoch, at.batch, at.step), at.loss_sum, at.samples)
    with loop.observers.running():
        for epoch in range(at.epoch, cfg.epochs):
            if not train_epoch(loop, state, epoch, at):
                break
    with loop.clock.measure("checkpoint"):
        loop.saver.wait()  # the last checkpoint is complete before the run is marked finished
    summary = _summary(loop, state, time.perf_counter() - loop.start)
    if directory is not None:  # every process: fsdp gathers the sharded weights
        with rundir.full_disk_said(directory):
            rt.save_weights(loop.model, directory / rundir.WEIGHTS)
    if directory is not None and rt.is_main:
        _finish(rt, cfg, directory, summary)
    loop.observers.close()  # after the files: MLflow keeps the final ones
    rt.barrier()
    return summary


def _set_up(
    rt: Runtime, cfg: TrainConfig, directory: Path | None, on_epoch: EpochCallback | None
) -> tuple[LoopParts, Position]:
    """The recipe's model, optimizer and data set up on ``rt``, the checkpoint resumed
    from, and the run's files and observers; where the run goes on from."""
    recipe = get_recipe(cfg.recipe)
    assert cfg.epochs is not None and cfg.batch_size is not None
    train_set, test_set = recipe.data(cfg)
    size = len(train_set) if isinstance(train_set, Sized) else None
    if size is not None and cfg.batch_size > size:  # one short batch an epoch, or none
        raise UserError(
            f"--batch-size {cfg.batch_size} is larger than the training set ({size} "
            f"samples); use at most {size}"
        )
    with torch.device("meta"):  # each process materialises its part (paratrain.models.meta_init)
        model = recipe.build_model(cfg)
    optimizer = recipe.build_optimizer(model.parameters(), cfg)
    plain_loss = recipe.build_loss()
    # handed to rt.setup: it advances only when a step applies gradients, as in users' loops
    scheduler = recipe.build_scheduler(optimizer, cfg) if recipe.build_scheduler else None
    model, optimizer, loss_fn, *rest = rt.setup(
        model, optimizer, plain_loss, scheduler, init_seed=cfg.seed
    )
    scheduler = rest[0] if rest else None
    train_loader, test_loader = _loaders(rt, cfg, recipe.drop_last, train_set, test_set)
    batches_per_epoch = len(train_loader)
    parts = TrainingParts(model, optimizer, scheduler, rt.precision.scaler)
    strategy = rt.strategy
    layout = ProcessLayout(
        strategy.collective, strategy.devices, strategy.name, strategy.data_leaders
    )
    resumed = cfg.resume_from is not None
    at = Position()
    if resumed:  # restores the random generators too: no random draw may come after this
        at = load_checkpoint(layout, Path(str(cfg.resume_from)), parts, batches_per_epoch)
        _resume_micro_batches(rt, at)
    writer = None
    if directory is not None and rt.is_main:
        writer = rundir.MetricsWriter(
            directory / rundir.METRICS, at.metrics_lines if resumed else None
        )
        rundir.write_config(directory, _config_payload(rt, cfg, "running"))
    saver = Checkpointer(layout, directory, cfg, parts, batches_per_epoch, at, writer)
    saver.micro_batch_split = lambda: _micro_batch_split(rt)
    saver.before_save = rt.settle  # the last step's checks are read before a checkpoint
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.accumulate)
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    watch = RunWatch(rt)  # throughput, MFU, peak memory
    purge_step = at.step if resumed else None
    observers = build_observers(rt, cfg, directory, writer, optimizer, watch, total, purge_step)
    loop = LoopParts(
        rt, cfg, model, optimizer, scheduler, loss_fn, plain_loss, recipe.classification,
        train_loader, test_loader, saver, watch, observers, total, steps_per_epoch, on_epoch,
        time.perf_counter(), LoopClock(rt.device),
    )  # fmt: skip
    return loop, at


def train_epoch(loop: LoopParts, state: LoopState, epoch: int, at: Position) -> bool:
    """Train ``epoch`` (from ``at`` where the run resumes in it), evaluate and checkpoint
    it; whether the run goes on to the next epoch."""
    batch = at.batch if epoch == at.epoch else 0
    if state.step >= loop.total and batch == 0:
        state.epoch = epoch - 1  # resumed from the checkpoint that ended the run: none trained
        return False
    state.epoch, state.batch = epoch, batch
    loop.train_loader.set_epoch(epoch, batch)
    loop.model.train()
    state.loss_sum = torch.zeros((), dtype=torch.float64, device=loop.rt.device)
    state.count = 0
    if epoch == at.epoch:
        state.loss_sum += at.loss_sum
        state.count = at.samples
    epoch_start, epoch_samples = time.perf_counter(), state.samples
    for x, y in loop.train_loader if state.step < loop.total else ():
        loss, applied = train_step(loop, state, x, y)
        if _after_step(loop, state, loss, applied, (x, y)):
            break
    return _end_epoch(loop, state, epoch_start, epoch_samples)


def _after_step(
    loop: LoopParts, state: LoopState, loss: torch.Tensor, applied: bool, batch: tuple[Any, Any]
) -> bool:
    """The observers, a ``--save-every`` checkpoint and the stops after a batch; whether
    the epoch ends here (``--max-steps`` reached)."""
    loop.clock.batch_done(state.samples)
    loop.watch.count(loop.model, loop.plain_loss, *batch)  # once, on the main process
    loop.observers.on_step(StepReport(state.epoch, state.step, state.samples, loss))
    if applied and loop.saver.due(state.step, state.batch):
        with loop.clock.measure("checkpoint"):
            loop.saver.save(state.epoch, state.batch, state.step, state.loss_sum, state.count)
    if state.step >= loop.total:
        return True
    if applied and _stop_asked(loop.rt):  # a signal: save this step, then stop
        position = (state.epoch, state.batch, state.step)
        _stop(loop, position, state.loss_sum, state.count)
    return False


def _end_epoch(loop: LoopParts, state: LoopState, epoch_start: float, epoch_samples: int) -> bool:
    """The epoch's mean loss, evaluation, records and checkpoint; whether the run goes on."""
    rt, saver, clock, epoch, step = loop.rt, loop.saver, loop.clock, state.epoch, state.step
    finished = state.batch == saver.batches_per_epoch
    if not finished:  # stopped by --max-steps: resumable from here
        with clock.measure("checkpoint"):
            saver.save(epoch, state.batch, step, state.loss_sum, state.count)
    state.train_loss = _mean_over_processes(rt, state.loss_sum, state.count)  # waits for it
    speed = (state.samples - epoch_samples) / max(time.perf_counter() - epoch_start, 1e-9)
    watched = {**loop.watch.record(speed), "peak_memory_bytes": loop.watch.peak_memory()}
    watched["threads"] = torch.get_num_threads()
    with clock.measure("eval"):
        state.eval_loss, state.eval_accuracy = evaluate(
            rt, loop.model, loop.test_loader, loop.plain_loss, loop.classification
        )
    report = EpochReport(
        epoch, step, state.samples, state.train_loss, state.eval_loss, state.eval_accuracy,
        speed, watched, loop.start,
    )  # fmt: skip
    loop.observers.on_epoch(report)
    saver.last_metrics = {
        "train_loss": state.train_loss,
        "eval_loss": state.eval_loss,
        "eval_accuracy": state.eval_accuracy,
    }
    if finished:
        with clock.measure("checkpoint"):
            saver.save(epoch + 1, 0, step)
    loop.observers.on_epoch_saved(replace(report, times=clock.end_epoch(epoch, step)))
    if loop.on_epoch is not None:
        saver.wait()  # the epoch's checkpoint is on disk before anyone reads it
        if rt.is_main:
            loop.on_epoch({"epoch": epoch, "step": step, **saver.last_metrics})
    if step >= loop.total:
        return False
    if _stop_asked(rt):  # arrived during the evaluation: the epoch's checkpoint
        _stop(loop, (epoch + 1, 0, step))
    return True


# -- the runtime's step: every call the loop makes on it is in this section -------------------


def train_step(loop: LoopParts, state: LoopState, x: Any, y: Any) -> tuple[torch.Tensor, bool]:
    """One batch: forward and backward (a micro-batch while accumulating), the optimizer
    step, the scheduler (rt.setup's: it advances where the gradients were applied), and the
    counting. Returns the batch's loss (on the device) and whether the optimizer step ended
    a group of micro-batches."""
    rt, model = loop.rt, loop.model
    with rt.accumulate(model):
        loss = rt.forward_backward(model, loop.loss_fn, x, y)
    applied = rt.sync_gradients
    loop.optimizer.step()
    loop.optimizer.zero_grad()
    if loop.scheduler is not None:
        loop.scheduler.step()
    info = batch_info(y)
    # a stand-in (a process with no sample of the last batch) trains on weight 0: no sample
    counted = 0 if info is not None and info.stand_in else len(y)
    if not rt.step_skipped and counted:  # --skip-nonfinite: no NaN in the epoch's mean
        state.loss_sum += loss.detach().double() * counted
        state.count += counted
    state.samples += len(y) * rt.strategy.data_shards
    state.batch += 1
    state.step += applied
    return loss, applied


def _stop_asked(rt: Runtime) -> bool:
    """Whether a signal reached any process (they agree; see ``Runtime.should_stop``)."""
    return rt.should_stop()


def _count_steps_from(rt: Runtime, step: int) -> None:
    """The runtime names steps by their number in the whole run (a resumed one too)."""
    rt.state.step = step


def _resume_micro_batches(rt: Runtime, at: Position) -> None:
    """--oom auto: the pieces per micro-batch the resumed run had come to."""
    if rt.micro_batches.active:
        rt.micro_batches.split = max(rt.micro_batches.split, at.micro_batch_split)


def _micro_batch_split(rt: Runtime) -> int:
    """--oom auto's pieces per micro-batch now (saved with every checkpoint)."""
    return rt.micro_batches.split


def _summary(loop: LoopParts, state: LoopState, seconds: float) -> Summary:
    """The run's figures, --oom auto's pieces among them."""
    summary = Summary(
        state.epoch + 1, state.step, seconds, state.train_loss, state.eval_loss,
        state.eval_accuracy, state.samples / max(seconds, 1e-9),
    )  # fmt: skip
    summary.times = loop.clock.times(state.samples)
    summary.epochs_trained = state.step / max(1, loop.steps_per_epoch)
    summary.micro_batch_split = loop.rt.micro_batches.split
    summary.halved_at_step = loop.rt.micro_batches.halved_at
    summary.piece_samples = loop.rt.micro_batches.piece_samples
    return summary


def _stop(
    loop: LoopParts, position: tuple[int, int, int], loss_sum: Any = 0.0, count: int = 0
) -> NoReturn:
    """Stop on a signal: checkpoint ``position`` (epoch, batch, step), wait until it is
    complete, and raise ``Stopped`` (nothing is saved twice for one position)."""
    epoch, batch, step = position
    saver, clock = loop.saver, loop.clock
    with clock.measure("checkpoint"):
        saver.save(epoch, batch, step, loss_sum, count)
        saver.wait()
    checkpoint = None
    if saver.run_dir is not None:
        checkpoint = saver.run_dir / CHECKPOINTS / checkpoint_name(step)
    loop.rt.exit_stopped(checkpoint, step)


#: the evaluation batch is this many times the training batch
EVAL_BATCH_FACTOR = 4


def _loaders(
    rt: Runtime, cfg: TrainConfig, drop_last: bool, train_set: Any, test_set: Any
) -> tuple[DeviceLoader, DeviceLoader]:
    """The training loader (shuffled, global batches) and the evaluation loader."""
    path, budget = cfg.data_path, cfg.device_budget_gib
    # an iterable data set (tar shards) shuffles itself
    shuffle = not isinstance(train_set, IterableDataset)
    train_loader = rt.setup_loader(
        DataLoader(train_set, batch_size=cfg.batch_size, shuffle=shuffle, drop_last=drop_last),
        data_path=path,
        device_budget_gib=budget,
    )
    # Evaluation keeps no activations for a backward pass: a larger batch (EVAL_BATCH_FACTOR
    # times the training batch) launches fewer kernels; every sample still counts once.
    assert cfg.batch_size is not None
    eval_batch = cfg.batch_size * EVAL_BATCH_FACTOR
    test_loader = rt.setup_loader(
        DataLoader(test_set, batch_size=eval_batch),
        evaluation=True,
        data_path=path,
        device_budget_gib=budget,
    )
    return train_loader, test_loader


def _mean_over_processes(rt: Runtime, loss_sum: torch.Tensor, count: int) -> float:
    """The epoch's mean training loss over every sample of every process."""
    counted = torch.tensor(float(count), dtype=torch.float64, device=rt.device)
    totals = rt.all_reduce(torch.stack([loss_sum, counted]), "sum").cpu()
    return totals[0].item() / max(totals[1].item(), 1.0)


def _finish(rt: Runtime, cfg: TrainConfig, directory: Path, summary: Summary) -> None:
    """config.json marked finished with the summary (after the final weights)."""
    payload = _config_payload(rt, cfg, "finished")
    payload["summary"] = dataclasses.asdict(summary)
    hugging_face = get_recipe(cfg.recipe).hugging_face_config
    if hugging_face is not None:  # RUN/hf/: what from_pretrained loads
        rundir.write_hugging_face_folder(directory, hugging_face)
    rundir.write_config(directory, payload)


def _config_payload(rt: Runtime, cfg: TrainConfig, status: str) -> dict[str, Any]:
    return {
        "status": status,
        "config": cfg.to_dict(),
        "runtime": rt.describe(),
        "versions": rundir.versions(),
    }
