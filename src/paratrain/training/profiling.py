"""``--profile STEPS``: a torch profiler trace of training steps, one file per process in
``RUN/profile/``, which TensorBoard's profiler plugin and Perfetto (ui.perfetto.dev) open."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratrain.training.run_files import PROFILE

#: the folder of the run directory the traces go to
PROFILE_DIR = PROFILE


class StepProfiler:
    """Profiles ``steps`` batches after one batch of warm-up (the first batch pays for
    start-up work that is not a step's); nothing at all when ``steps`` is None."""

    def __init__(
        self, directory: Path | None, steps: int | None, rank: int, device_type: str = "cpu"
    ) -> None:
        self._profiler: Any = None
        if directory is None or not steps:
            return
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU]
        if device_type == "cuda":  # the run's device: a CPU run on a GPU machine has no kernels
            activities.append(ProfilerActivity.CUDA)
        self.folder = directory / PROFILE_DIR
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(self.folder), f"rank{rank}"),
            record_shapes=True,
        )
        self._profiler.start()

    def step(self) -> None:
        """After every batch: the trace is written once ``steps`` were recorded."""
        if self._profiler is not None:
            self._profiler.step()

    def close(self) -> None:
        """Stops a profiler whose steps were not all run (the trace has those that were)."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
