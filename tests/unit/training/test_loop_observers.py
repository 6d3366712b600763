"""What watches the training loop is a ``LoopObserver``: called in order at fixed moments,
left in reverse order, and chosen in one place (``build_observers``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain.runtime.facade import Runtime
from paratrain.training import loop, rundir
from paratrain.training.config import TrainConfig
from paratrain.training.loggers import ContentionNote, MetricsLog, TimingsLog, build_observers
from paratrain.training.observer import EpochReport, LoopObserver, Observers, StepReport
from paratrain.training.recipes import get_recipe
from paratrain.training.watch import RunWatch


class Recorder(LoopObserver):
    """Notes every hook it sees; ``done`` is noted only when training ends without error."""

    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self.log = name, log

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        self.log.append((self.name, "start"))
        yield
        self.log.append((self.name, "done"))

    def running(self) -> AbstractContextManager[None]:
        return self._running()

    def on_step(self, report: StepReport) -> None:
        self.log.append((self.name, "step", report.step))

    def on_epoch(self, report: EpochReport) -> None:
        self.log.append((self.name, "epoch", report.epoch, bool(report.times)))

    def on_epoch_saved(self, report: EpochReport) -> None:
        self.log.append((self.name, "saved", report.epoch, sorted(report.times)[:2]))

    def close(self) -> None:
        self.log.append((self.name, "close"))


def _epoch(epoch: int) -> EpochReport:
    return EpochReport(epoch, 3, 96, 1.0, 2.0, None, 10.0, {"mfu": None}, 0.0)


def test_observers_are_called_in_their_order_and_left_in_reverse() -> None:
    log: list[tuple[Any, ...]] = []
    observers = Observers([Recorder("a", log), Recorder("b", log)])
    with observers.running():
        observers.on_step(StepReport(0, 1, 32, torch.tensor(0.5)))
        observers.on_epoch(_epoch(0))
        observers.on_epoch_saved(_epoch(0))
    observers.close()
    assert log == [
        ("a", "start"),
        ("b", "start"),
        ("a", "step", 1),
        ("b", "step", 1),
        ("a", "epoch", 0, False),
        ("b", "epoch", 0, False),
        ("a", "saved", 0, []),
        ("b", "saved", 0, []),
        ("b", "done"),
        ("a", "done"),
        ("a", "close"),
        ("b", "close"),
    ]


def test_an_error_leaves_running_without_what_follows_training() -> None:
    log: list[tuple[Any, ...]] = []
    with pytest.raises(RuntimeError), Observers([Recorder("a", log)]).running():
        raise RuntimeError("a step failed")
    assert log == [("a", "start")]  # the profiler and TensorBoard stay as they were


def test_build_observers_chooses_the_runs_loggers(tmp_path: Path) -> None:
    rt = Runtime(strategy="cpu")
    cfg = TrainConfig(recipe="digits", strategy="cpu", progress=False).resolved(get_recipe)
    writer = rundir.MetricsWriter(tmp_path / rundir.METRICS)
    with_files = build_observers(rt, cfg, tmp_path, writer, None, RunWatch(rt), 10, None)
    kinds = [type(member) for member in with_files.members]
    assert kinds == [ContentionNote, MetricsLog, TimingsLog]
    without = build_observers(rt, cfg, None, None, None, RunWatch(rt), 10, None)
    assert [type(member) for member in without.members] == [ContentionNote]
    with_files.close()


@pytest.mark.slow
def test_an_observer_added_in_build_observers_sees_the_whole_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[tuple[Any, ...]] = []
    built = loop.build_observers

    def with_recorder(*args: Any) -> Observers:
        observers = built(*args)
        observers.members.append(Recorder("r", log))
        return observers

    def finished() -> bool:
        config = json.loads((tmp_path / "run" / rundir.CONFIG).read_text())
        return config["status"] == "finished" and (tmp_path / "run" / rundir.WEIGHTS).is_file()

    closed_after_files: list[bool] = []
    monkeypatch.setattr(loop, "build_observers", with_recorder)
    monkeypatch.setattr(Recorder, "close", lambda self: closed_after_files.append(finished()))
    (tmp_path / "run").mkdir()
    cfg = TrainConfig(recipe="linear", strategy="cpu", epochs=2, progress=False)
    cfg = cfg.resolved(get_recipe)
    summary = loop.train(Runtime(strategy="cpu", seed=0), cfg, tmp_path / "run")
    steps = [entry[2] for entry in log if entry[1] == "step"]
    assert steps == list(range(1, summary.steps + 1))  # one report per batch, no accumulation
    epochs = [entry for entry in log if entry[1] in ("epoch", "saved")]
    assert epochs == [
        ("r", "epoch", 0, False),
        ("r", "saved", 0, ["checkpoint_seconds", "epoch"]),
        ("r", "epoch", 1, False),
        ("r", "saved", 1, ["checkpoint_seconds", "epoch"]),
    ]
    assert log[0] == ("r", "start") and log[-1] == ("r", "done")
    assert closed_after_files == [True]
