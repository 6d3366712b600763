"""The training loop behind `paratrain train`, written only against the Runtime."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.data import DataLoader

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
from paratrain.data.loaders import DeviceLoader
from paratrain.launching.threads import ContentionGuard, load_note
from paratrain.runtime.facade import Runtime
from paratrain.training import rundir
from paratrain.training.config import TrainConfig
from paratrain.training.loop_timing import LoopClock, LoopTimes
from paratrain.training.mlflow_logger import MlflowLogger
from paratrain.training.profiling import StepProfiler
from paratrain.training.progress import TrainProgress
from paratrain.training.recipes import get_recipe
from paratrain.training.tensorboard_logger import TensorBoardLogger
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
            output = inner(x).float()
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


#: called on the main process after each epoch (see ``train``)
EpochCallback = Callable[[dict[str, Any]], None]


def train(
    rt: Runtime, cfg: TrainConfig, directory: Path | None, on_epoch: EpochCallback | None = None
) -> Summary:
    """Train ``cfg.recipe`` with ``rt``; the main process writes ``directory``'s files.

    Checkpoints go to ``directory/checkpoints``; ``cfg.resume_from`` continues from one.
    ``on_epoch`` (``paratrain tune`` reports to Ray Tune with it) is called on the main
    process after each epoch's evaluation and end-of-epoch checkpoint, with ``epoch``,
    ``step``, ``train_loss``, ``eval_loss`` and ``eval_accuracy`` (None for regression).
    """
    recipe = get_recipe(cfg.recipe)
    assert cfg.epochs is not None and cfg.batch_size is not None
    train_set, test_set = recipe.build_data(cfg)
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
    model, optimizer, loss_fn = rt.setup(model, optimizer, plain_loss, init_seed=cfg.seed)
    scheduler = recipe.build_scheduler(optimizer, cfg) if recipe.build_scheduler else None
    train_loader, test_loader = _loaders(rt, cfg, recipe.drop_last, train_set, test_set)
    batches_per_epoch = len(train_loader)
    parts = TrainingParts(model, optimizer, scheduler, rt.precision.scaler)
    layout = ProcessLayout(rt.strategy.collective, rt.strategy.devices, rt.strategy.name)
    resumed = cfg.resume_from is not None
    at = Position()
    if resumed:  # restores the random generators too: no random draw may come after this
        at = load_checkpoint(layout, Path(str(cfg.resume_from)), parts, batches_per_epoch)
        if rt.micro_batches.active:  # --oom auto: the pieces it had come to
            rt.micro_batches.split = max(rt.micro_batches.split, at.micro_batch_split)
    writer = None
    if directory is not None and rt.is_main:
        keep_lines = at.metrics_lines if resumed else None
        writer = rundir.MetricsWriter(directory / rundir.METRICS, keep_lines)
        rundir.write_config(directory, _config_payload(rt, cfg, "running"))
    saver = Checkpointer(layout, directory, cfg, parts, batches_per_epoch, at, writer)
    saver.micro_batch_split = lambda: rt.micro_batches.split
    timings = None
    if directory is not None and rt.is_main:
        timings = rundir.MetricsWriter(directory / rundir.TIMINGS)
    tb = None  # --tensorboard: RUN/tensorboard/, written by the main process
    if cfg.tensorboard and directory is not None:
        tb = TensorBoardLogger(directory, rt, purge_step=at.step if resumed else None)
    ml = None  # --mlflow: one MLflow run, written by the main process
    if cfg.mlflow is not None and rt.is_main:
        ml = MlflowLogger(cfg.mlflow, directory.name if directory is not None else cfg.recipe)
        ml.log_params({"config": cfg.to_dict(), "runtime": rt.describe()})

    steps_per_epoch = math.ceil(batches_per_epoch / cfg.accumulate)
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    step, samples, start = at.step, 0, time.perf_counter()
    clock = LoopClock(rt.device)
    watch = RunWatch(rt)  # throughput, MFU, peak memory
    profiler = StepProfiler(directory, cfg.profile, rt.rank)
    # other work that starts later is said once; the thread count stays (threads.py)
    contention = ContentionGuard(torch.get_num_threads() if rt.threads.source == "chosen" else 1)
    if rt.world_size == 1 and (note := load_note(rt.threads, 1)) is not None:
        print(f"paratrain: note: {note}", file=sys.stderr, flush=True)  # launchers say theirs
    rt.state.step = step  # steps are named by their number in the whole run
    last = at.last_metrics  # a resumed run that trains no further still has its figures
    train_loss, eval_loss = last.get("train_loss", math.nan), last.get("eval_loss", math.nan)
    accuracy = last.get("eval_accuracy")
    epoch = at.epoch - 1
    if rt.should_stop():  # from here on a signal stops after a step (and before the first)
        _stop(rt, saver, clock, (at.epoch, at.batch, step), at.loss_sum, at.samples)
    with TrainProgress(total, enabled=cfg.progress and rt.is_main) as bar:
        bar.mfu_of = watch.mfu
        for epoch in range(at.epoch, cfg.epochs):
            batch = at.batch if epoch == at.epoch else 0
            if step >= total and batch == 0:
                epoch -= 1  # resumed from the checkpoint that ended the run: none trained here
                break
            train_loader.set_epoch(epoch, batch)
            model.train()
            loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
            count = 0
            if epoch == at.epoch:
                loss_sum += at.loss_sum
                count = at.samples
            epoch_start, epoch_samples = time.perf_counter(), samples
            for x, y in train_loader if step < total else ():
                with rt.accumulate(model):
                    loss = rt.forward_backward(model, loss_fn, x, y)
                applied = rt.sync_gradients
                optimizer.step()
                optimizer.zero_grad()
                if applied and scheduler is not None:
                    scheduler.step()
                if not rt.step_skipped:  # --skip-nonfinite: no NaN in the epoch's mean
                    loss_sum += loss.detach().double() * len(y)
                    count += len(y)
                samples += len(y) * rt.strategy.data_shards
                batch += 1
                step += applied
                clock.batch_done(samples)
                watch.count(model, plain_loss, x, y)  # once, on the main process
                profiler.step()
                if (note := contention.check()) is not None:
                    print(f"paratrain: note: rank {rt.rank}: {note}", file=sys.stderr, flush=True)
                if bar.due():
                    bar.update(step, epoch, loss.item(), samples)
                if tb is not None and tb.due():
                    tb.log({"loss/train": loss.item()}, step)
                if applied and saver.due(step, batch):
                    with clock.measure("checkpoint"):
                        saver.save(epoch, batch, step, loss_sum, count)
                if step >= total:
                    break
                if applied and rt.should_stop():  # a signal: save this step, then stop
                    _stop(rt, saver, clock, (epoch, batch, step), loss_sum, count)
            if batch < batches_per_epoch:  # stopped by --max-steps: resumable from here
                with clock.measure("checkpoint"):
                    saver.save(epoch, batch, step, loss_sum, count)
            train_loss = _mean_over_processes(rt, loss_sum, count)  # waits for the device
            speed = (samples - epoch_samples) / max(time.perf_counter() - epoch_start, 1e-9)
            watched = {**watch.record(speed), "peak_memory_bytes": watch.peak_memory()}
            watched["threads"] = torch.get_num_threads()
            with clock.measure("eval"):
                eval_loss, accuracy = evaluate(
                    rt, model, test_loader, plain_loss, recipe.classification
                )
            bar.update(step, epoch, train_loss, samples)
            if writer is not None:
                writer.write(_record(epoch, step, "train", train_loss, None))
                writer.write(_record(epoch, step, "eval", eval_loss, accuracy))
            if ml is not None:
                ml.log(
                    {
                        "train_loss": train_loss,
                        "eval_loss": eval_loss,
                        "eval_accuracy": accuracy,
                        "samples_per_second": speed,
                        "mfu": watched["mfu"],
                    },
                    step,
                )
            if tb is not None:
                epoch_values = {"loss/train_epoch": train_loss, "loss/eval": eval_loss}
                tb.log({**epoch_values, "accuracy/eval": accuracy}, step)
                tb.log_progress(step, optimizer, samples / max(time.perf_counter() - start, 1e-9))
                tb.log({"throughput/mfu": watched["mfu"]}, step)
            saver.last_metrics = {
                "train_loss": train_loss,
                "eval_loss": eval_loss,
                "eval_accuracy": accuracy,
            }
            if batch == batches_per_epoch:
                with clock.measure("checkpoint"):
                    saver.save(epoch + 1, 0, step)
            if timings is not None:
                # measured, not reproducible: beside the timings, not in metrics.jsonl
                timings.write({**clock.end_epoch(epoch, step), **watched})
            if on_epoch is not None:
                saver.wait()  # the epoch's checkpoint is on disk before anyone reads it
                if rt.is_main:
                    on_epoch({"epoch": epoch, "step": step, **saver.last_metrics})
            if step >= total:
                break
            if rt.should_stop():  # arrived during the evaluation: the epoch's checkpoint
                _stop(rt, saver, clock, (epoch + 1, 0, step))
    profiler.close()
    with clock.measure("checkpoint"):
        saver.wait()  # the last checkpoint is complete before the run is marked finished
    seconds = time.perf_counter() - start
    if tb is not None:
        tb.close()
    summary = Summary(
        epoch + 1, step, seconds, train_loss, eval_loss, accuracy, samples / max(seconds, 1e-9)
    )
    summary.times = clock.times(samples)
    summary.epochs_trained = step / max(1, steps_per_epoch)
    summary.micro_batch_split = rt.micro_batches.split
    summary.halved_at_step = rt.micro_batches.halved_at
    summary.piece_samples = rt.micro_batches.piece_samples
    if timings is not None:
        timings.close()
    if directory is not None:  # every process: fsdp gathers the sharded weights
        with rundir.full_disk_said(directory):
            rt.save_weights(model, directory / rundir.WEIGHTS)
    if writer is not None and directory is not None:
        writer.close()
        _finish(rt, cfg, directory, summary)
    if ml is not None:  # the final weights and config.json as the run's artifacts
        ml.finish(
            [] if directory is None else [directory / rundir.WEIGHTS, directory / rundir.CONFIG]
        )
    rt.barrier()
    return summary


def _stop(
    rt: Runtime,
    saver: Checkpointer,
    clock: LoopClock,
    position: tuple[int, int, int],
    loss_sum: Any = 0.0,
    count: int = 0,
) -> NoReturn:
    """Stop on a signal: checkpoint ``position`` (epoch, batch, step), wait until it is
    complete, and raise ``Stopped`` (nothing is saved twice for one position)."""
    epoch, batch, step = position
    with clock.measure("checkpoint"):
        saver.save(epoch, batch, step, loss_sum, count)
        saver.wait()
    checkpoint = None
    if saver.run_dir is not None:
        checkpoint = saver.run_dir / CHECKPOINTS / checkpoint_name(step)
    rt.exit_stopped(checkpoint, step)


#: the evaluation batch is this many times the training batch
EVAL_BATCH_FACTOR = 4


def _loaders(
    rt: Runtime, cfg: TrainConfig, drop_last: bool, train_set: Any, test_set: Any
) -> tuple[DeviceLoader, DeviceLoader]:
    """The training loader (shuffled, global batches) and the evaluation loader."""
    path, budget = cfg.data_path, cfg.device_budget_gib
    train_loader = rt.setup_loader(
        DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, drop_last=drop_last),
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
    rundir.write_config(directory, payload)


def _record(
    epoch: int, step: int, split: str, loss: float, accuracy: float | None
) -> dict[str, Any]:
    record: dict[str, Any] = {"epoch": epoch, "step": step, "split": split, "loss": loss}
    if accuracy is not None:
        record["accuracy"] = accuracy
    return record


def _config_payload(rt: Runtime, cfg: TrainConfig, status: str) -> dict[str, Any]:
    return {
        "status": status,
        "config": cfg.to_dict(),
        "runtime": rt.describe(),
        "versions": rundir.versions(),
    }
