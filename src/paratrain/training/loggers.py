"""The training loop's observers: metrics.jsonl, timings.jsonl, TensorBoard, MLflow, the
progress bar, the profiler and the note on contended cores. :func:`build_observers` is the
one place that decides which a run has: a new logger is a class here and a line there."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from paratrain.launching.threads import ContentionGuard
from paratrain.runtime.facade import Runtime
from paratrain.training import rundir
from paratrain.training.config import TrainConfig
from paratrain.training.mlflow_logger import MlflowLogger
from paratrain.training.observer import EpochReport, LoopObserver, Observers, StepReport
from paratrain.training.profiling import StepProfiler
from paratrain.training.progress import TrainProgress
from paratrain.training.tensorboard_logger import TensorBoardLogger
from paratrain.training.watch import RunWatch


def epoch_record(
    epoch: int, step: int, split: str, loss: float, accuracy: float | None
) -> dict[str, Any]:
    """One line of metrics.jsonl."""
    record: dict[str, Any] = {"epoch": epoch, "step": step, "split": split, "loss": loss}
    if accuracy is not None:
        record["accuracy"] = accuracy
    return record


class MetricsLog(LoopObserver):
    """metrics.jsonl: the epoch's training and evaluation figures (main process)."""

    def __init__(self, writer: rundir.MetricsWriter) -> None:
        self.writer = writer

    def on_epoch(self, report: EpochReport) -> None:
        self.writer.write(epoch_record(report.epoch, report.step, "train", report.train_loss, None))
        self.writer.write(
            epoch_record(report.epoch, report.step, "eval", report.eval_loss, report.eval_accuracy)
        )

    def close(self) -> None:
        self.writer.close()


class TimingsLog(LoopObserver):
    """timings.jsonl: measured, not reproducible, so beside metrics.jsonl (main process)."""

    def __init__(self, writer: rundir.MetricsWriter) -> None:
        self.writer = writer

    def on_epoch_saved(self, report: EpochReport) -> None:
        self.writer.write({**report.times, **report.watched})

    def close(self) -> None:
        self.writer.close()


class ProgressBar(LoopObserver):
    """The progress bar (main process, ``--no-progress`` turns it off)."""

    def __init__(self, total_steps: int, watch: RunWatch) -> None:
        self.total_steps = total_steps
        self.watch = watch
        self.bar: TrainProgress | None = None

    @contextlib.contextmanager
    def _shown(self) -> Iterator[None]:
        with TrainProgress(self.total_steps, enabled=True) as bar:
            bar.mfu_of = self.watch.mfu
            self.bar = bar
            yield

    def running(self) -> AbstractContextManager[None]:
        return self._shown()

    def on_step(self, report: StepReport) -> None:
        if self.bar is not None and self.bar.due():
            self.bar.update(report.step, report.epoch, report.loss.item(), report.samples)

    def on_epoch(self, report: EpochReport) -> None:
        if self.bar is not None:
            self.bar.update(report.step, report.epoch, report.train_loss, report.samples)


class TensorBoard(LoopObserver):
    """``--tensorboard``: RUN/tensorboard/, written by the main process."""

    def __init__(self, logger: TensorBoardLogger, optimizer: Any) -> None:
        self.logger = logger
        self.optimizer = optimizer

    @contextlib.contextmanager
    def _closed_after(self) -> Iterator[None]:
        yield
        self.logger.close()  # once training is done: not after an error

    def running(self) -> AbstractContextManager[None]:
        return self._closed_after()

    def on_step(self, report: StepReport) -> None:
        if self.logger.due():
            self.logger.log({"loss/train": report.loss.item()}, report.step)

    def on_epoch(self, report: EpochReport) -> None:
        tb, step = self.logger, report.step
        epoch_values = {"loss/train_epoch": report.train_loss, "loss/eval": report.eval_loss}
        tb.log({**epoch_values, "accuracy/eval": report.eval_accuracy}, step)
        speed = report.samples / max(time.perf_counter() - report.started, 1e-9)
        tb.log_progress(step, self.optimizer, speed)
        tb.log({"throughput/mfu": report.watched["mfu"]}, step)


class Mlflow(LoopObserver):
    """``--mlflow``: one MLflow run, written by the main process; the final weights and
    config.json become its artifacts."""

    def __init__(self, logger: MlflowLogger, directory: Path | None) -> None:
        self.logger = logger
        self.directory = directory

    def on_epoch(self, report: EpochReport) -> None:
        self.logger.log(
            {
                "train_loss": report.train_loss,
                "eval_loss": report.eval_loss,
                "eval_accuracy": report.eval_accuracy,
                "samples_per_second": report.samples_per_second,
                "mfu": report.watched["mfu"],
            },
            report.step,
        )

    def close(self) -> None:
        directory = self.directory
        files = [] if directory is None else [directory / rundir.WEIGHTS, directory / rundir.CONFIG]
        self.logger.finish(files)


class Profiler(LoopObserver):
    """``--profile STEPS``: a trace of the first steps, one file per process."""

    def __init__(self, directory: Path, steps: int, rank: int, device_type: str) -> None:
        self.directory, self.steps, self.rank = directory, steps, rank
        self.device_type = device_type
        self.profiler: StepProfiler | None = None

    @contextlib.contextmanager
    def _profiled(self) -> Iterator[None]:
        self.profiler = StepProfiler(self.directory, self.steps, self.rank, self.device_type)
        yield
        self.profiler.close()  # once training is done: not after an error

    def running(self) -> AbstractContextManager[None]:
        return self._profiled()

    def on_step(self, report: StepReport) -> None:
        if self.profiler is not None:
            self.profiler.step()


class ContentionNote(LoopObserver):
    """Other work that starts later is said once; the thread count stays (threads.py)."""

    def __init__(self, rt: Runtime) -> None:
        self.rank = rt.rank
        self.guard = ContentionGuard(
            torch.get_num_threads() if rt.threads.source == "chosen" else 1
        )

    def on_step(self, report: StepReport) -> None:
        if (note := self.guard.check()) is not None:
            print(f"paratrain: note: rank {self.rank}: {note}", file=sys.stderr, flush=True)


def build_observers(
    rt: Runtime,
    cfg: TrainConfig,
    directory: Path | None,
    metrics: rundir.MetricsWriter | None,
    optimizer: Any,
    watch: RunWatch,
    total_steps: int,
    purge_step: int | None,
) -> Observers:
    """The run's observers, in the order their hooks are called. ``metrics``: the main
    process's metrics.jsonl (its checkpoints count its lines); ``purge_step``: where a
    resumed run continues (TensorBoard drops the events it wrote from there on)."""
    main = rt.is_main
    timings = None
    if directory is not None and main:
        timings = TimingsLog(rundir.MetricsWriter(directory / rundir.TIMINGS))
    tensorboard = None
    if cfg.tensorboard and directory is not None:
        logger = TensorBoardLogger(directory, rt, purge_step=purge_step)
        tensorboard = TensorBoard(logger, optimizer)
    mlflow = None
    if cfg.mlflow is not None and main:
        ml = MlflowLogger(cfg.mlflow, directory.name if directory is not None else cfg.recipe)
        ml.log_params({"config": cfg.to_dict(), "runtime": rt.describe()})
        mlflow = Mlflow(ml, directory)
    members = [
        Profiler(directory, cfg.profile, rt.rank, rt.device.type)
        if directory is not None and cfg.profile
        else None,
        ContentionNote(rt),
        ProgressBar(total_steps, watch) if cfg.progress and main else None,
        MetricsLog(metrics) if metrics is not None else None,
        mlflow,
        tensorboard,
        timings,
    ]
    return Observers([member for member in members if member is not None])
