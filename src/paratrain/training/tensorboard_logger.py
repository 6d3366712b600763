"""TensorBoard logging from the main process: `train --tensorboard` and your own loop.

logger = paratrain.TensorBoardLogger("runs/x", rt)   # event files in runs/x/tensorboard/
logger.log({"loss/train": loss.item()}, step)        # a no-op on every other process
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import torch

from paratrain.training.run_files import TENSORBOARD
from paratrain.utils.errors import UserError
from paratrain.utils.peak_memory import peak_memory_bytes

TENSORBOARD_DIR = TENSORBOARD
MISSING_TENSORBOARD = (
    'TensorBoard logging needs the tensorboard package: pip install "paratrain[tensorboard]"'
)


class MainProcess(Protocol):
    """What the logger needs of a Runtime: whether this is the process that writes."""

    @property
    def is_main(self) -> bool: ...

    @property
    def device(self) -> torch.device: ...


def require_tensorboard() -> None:
    """``UserError`` saying how to install tensorboard, where it is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UserError(MISSING_TENSORBOARD) from None


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class TensorBoardLogger:
    """Scalars into ``run_dir/tensorboard/``, written by the main process only.

    ``rt`` (a :class:`paratrain.Runtime`) says which process is the main one; without it,
    rank 0 of the default process group (or the only process) writes. ``purge_step``: on a
    resumed run, events from this step on are dropped, so a replayed stretch is not drawn
    twice. The other processes open nothing and ``log`` does nothing there, so every process
    can run the same code.
    """

    def __init__(
        self,
        run_dir: str | Path,
        rt: MainProcess | None = None,
        purge_step: int | None = None,
        every_seconds: float = 1.0,
    ) -> None:
        self.directory = Path(run_dir) / TENSORBOARD_DIR
        self._device = rt.device if rt is not None else torch.device("cpu")
        self._every = every_seconds
        self._last = -float("inf")
        self._writer: Any = None
        if rt.is_main if rt is not None else _is_rank_zero():
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.directory), purge_step=purge_step)

    @property
    def enabled(self) -> bool:
        """Whether this process writes (the main one)."""
        return self._writer is not None

    def due(self) -> bool:
        """At most one per-step point per ``every_seconds``: reading a loss syncs the GPU."""
        if self._writer is None:
            return False
        now = time.monotonic()
        if now - self._last < self._every:
            return False
        self._last = now
        return True

    def log(self, values: Mapping[str, float | int | torch.Tensor | None], step: int) -> None:
        """One scalar per tag at ``step``; None values are skipped."""
        if self._writer is None:
            return
        for tag, value in values.items():
            if value is None:
                continue
            scalar = value.item() if isinstance(value, torch.Tensor) else float(value)
            self._writer.add_scalar(tag, scalar, step)

    def log_progress(
        self, step: int, optimizer: Any = None, samples_per_second: float | None = None
    ) -> None:
        """Learning rate, throughput and peak memory (MiB) at ``step``, then flush."""
        if self._writer is None:
            return
        groups = getattr(optimizer, "param_groups", None) or [{}]
        peak = peak_memory_bytes(self._device)
        self.log(
            {
                "lr": groups[0].get("lr"),
                "throughput/samples_per_second": samples_per_second,
                "memory/peak_mib": None if peak is None else peak / 2**20,
            },
            step,
        )
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
