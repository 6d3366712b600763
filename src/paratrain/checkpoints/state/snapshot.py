"""What the training loop saves in a checkpoint and how a resumed run reads it back.

One checkpoint directory (see :mod:`.store`) holds:

* ``model.safetensors``: the weights, plain parameter names (full tensors, also under FSDP);
* ``optimizer.pt``, ``scheduler.pt`` (a recipe with a scheduler), ``scaler.pt`` (fp16 on
  CUDA): their ``state_dict()`` (an FSDP optimizer's state gathered whole: the same file as
  one process writes);
* ``rng-rank{R}.pt``: the generator states of process R (Python, NumPy, torch CPU, CUDA),
  gathered to the main process, which alone writes;
* ``manifest.json``, written last: the step, and every other file's size and checksum,
  verified before a checkpoint is loaded (:mod:`.manifest`);
* ``state.json``: where training stands (``epoch``, ``batch`` = global batches of that epoch
  already trained, ``step``), each process's running train-loss sum for the epoch, how many
  lines ``metrics.jsonl`` had, and the settings that must match to resume (recipe, batch
  size, seed, accumulate, precision, world size, strategy).

Every ``.pt`` file holds only tensors and plain containers: ``torch.load(weights_only=True)``
reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file
from torch import nn

from paratrain.checkpoints.files import load_weights
from paratrain.checkpoints.files.readers import read_torch
from paratrain.checkpoints.state import manifest
from paratrain.checkpoints.state.background import BackgroundWriter, detached_copy
from paratrain.checkpoints.state.collect import gather_to_main
from paratrain.checkpoints.state.rng import capture_rng, restore_rng
from paratrain.checkpoints.state.sharded import (
    load_optimizer_state,
    model_state,
    optimizer_state,
)
from paratrain.checkpoints.state.store import (
    CHECKPOINTS,
    STATE,
    WEIGHTS,
    FileWriter,
    checkpoint_name,
    checkpoint_step,
    write_checkpoint,
)
from paratrain.distributed.collective import Collective
from paratrain.utils.errors import UserError
from paratrain.utils.tensor_bytes import tensor_bytes
from paratrain.version import __version__

#: 2: with a manifest (:mod:`.manifest`); 1: written before manifests, read unverified
FORMAT = 2
#: settings a checkpoint can only be resumed with (the data position and step count
#: depend on them)
MUST_MATCH = ("recipe", "batch_size", "seed", "accumulate", "precision")


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


@dataclass(frozen=True)
class ProcessLayout:
    """The processes a checkpoint is saved from or loaded into, seen from one of them."""

    collective: Collective
    #: this process's devices, whose random generators are saved and restored
    devices: Sequence[torch.device]
    #: the strategy's name, recorded in ``state.json``
    strategy: str
    #: the ranks that stand for the data (one per part of the global batch: a tp group or a
    #: pipeline's stages share one); None: every rank
    data_leaders: Sequence[int] | None = None


class CheckpointSettings(Protocol):
    """The run settings a checkpoint records and obeys (the training configuration)."""

    recipe: str
    batch_size: int | None
    seed: int
    accumulate: int
    precision: str
    save_every: int | None
    keep: int
    resume_from: str | None


@dataclass
class Position:
    """Where training stands; what a checkpoint records and a resumed run starts from."""

    epoch: int = 0  # the epoch to continue in (0-based)
    batch: int = 0  # global batches of that epoch already trained on
    step: int = 0  # optimizer steps done
    loss_sum: float = 0.0  # this process's sum of loss x samples over those batches
    samples: int = 0  # this process's samples of those batches
    metrics_lines: int = 0  # lines of metrics.jsonl written so far
    #: the last finished epoch's train_loss, eval_loss, eval_accuracy
    last_metrics: dict[str, Any] = field(default_factory=dict)
    #: --oom auto: pieces per micro-batch after running out of memory (1: never)
    micro_batch_split: int = 1


@dataclass
class TrainingParts:
    """The objects whose state a checkpoint holds."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: torch.amp.GradScaler | None = None

    def stateful(self) -> dict[str, Any]:
        parts = {"optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler}
        return {name: obj for name, obj in parts.items() if obj is not None}


def read_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's ``state.json``, or ``UserError`` saying what is wrong with it."""
    path = checkpoint / STATE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{checkpoint} is not a checkpoint: it has no {STATE}") from None
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{path} is unreadable or not JSON ({exc}); resume from another checkpoint"
        ) from None
    needed = ("format", "epoch", "batch", "step", "world_size", "batches_per_epoch")
    if not isinstance(state, dict) or any(key not in state for key in needed):
        raise UserError(f"{path} is not a paratrain checkpoint state (needs {', '.join(needed)})")
    if state["format"] > FORMAT:
        raise UserError(f"{checkpoint} was written by a newer paratrain; upgrade to resume it")
    return state


class Checkpointer:
    """When and what the training loop saves: every ``save_every`` optimizer steps inside an
    epoch, at the end of every epoch, and where ``--max-steps`` stops training mid-epoch.

    Every process calls :meth:`save` at the same steps (their generator states are gathered);
    the main process writes, by default on a background thread (:mod:`.background`): call
    :meth:`wait` before relying on the files. Without a run directory nothing is saved.
    """

    def __init__(
        self,
        layout: ProcessLayout,
        run_dir: Path | None,
        cfg: CheckpointSettings,
        parts: TrainingParts,
        batches_per_epoch: int,
        start: Position,
        metrics: Any = None,
        background: bool = True,
    ) -> None:
        self.layout = layout
        self._writer = BackgroundWriter() if background else None
        self.metrics = metrics  # the main process's MetricsWriter: its line count is saved
        #: the last finished epoch's figures, saved with every checkpoint
        self.last_metrics: dict[str, Any] = dict(start.last_metrics)
        self.run_dir = run_dir
        self.parts = parts
        self.every = cfg.save_every
        self.keep = cfg.keep
        self.batches_per_epoch = batches_per_epoch
        self.info: dict[str, Any] = {
            **{name: getattr(cfg, name) for name in MUST_MATCH},
            "world_size": layout.collective.world_size,
            "strategy": layout.strategy,
            "devices": [str(d) for d in layout.devices],
            "batches_per_epoch": batches_per_epoch,
        }
        #: --oom auto's pieces per micro-batch now, saved with every checkpoint
        self.micro_batch_split: Callable[[], int] = lambda: start.micro_batch_split
        #: called on every process before anything is saved (the runtime reads the last
        #: step's checks there: nothing is saved from a step with a non-finite loss)
        self.before_save: Callable[[], None] = lambda: None
        resumed = cfg.resume_from is not None
        self._last = (start.epoch, start.batch, start.step) if resumed else None

    def due(self, step: int, batch: int) -> bool:
        """A ``save_every`` checkpoint after this step? (Not at an epoch's last batch: the
        end-of-epoch checkpoint follows.)"""
        return self.every is not None and step % self.every == 0 and batch < self.batches_per_epoch

    def save(
        self, epoch: int, batch: int, step: int, loss_sum: Any = 0.0, samples: int = 0
    ) -> Path | None:
        """Save the position (``batch`` global batches of ``epoch`` trained, ``step`` steps,
        this process's running ``loss_sum`` and ``samples``) and every part's state. Returns
        the checkpoint on the main process (written in the background: complete once
        :meth:`wait` returns); saves nothing twice for the same position."""
        self.before_save()
        if self.run_dir is None or (epoch, batch, step) == self._last:
            return None
        self._last = (epoch, batch, step)
        # Sharded (FSDP) tensors are gathered by every process: before the main one goes on.
        collective = self.layout.collective
        weights = model_state(collective, self.parts.model)
        optimizer = optimizer_state(collective, self.parts.optimizer)
        mine = {
            "rng": capture_rng(self.layout.devices),
            "loss_sum": float(loss_sum),
            "samples": samples,
        }
        gathered = gather_to_main(self.layout.collective, mine)
        if gathered is None:
            return None
        state = {
            "format": FORMAT,
            "epoch": epoch,
            "batch": batch,
            "step": step,
            **self.info,
            "epoch_loss_sums": [g["loss_sum"] for g in gathered],
            "epoch_samples": [g["samples"] for g in gathered],
            "epoch_data_leaders": list(self.layout.data_leaders or range(len(gathered))),
            "metrics_lines": self.metrics.lines if self.metrics is not None else 0,
            "last_metrics": self.last_metrics,
            "micro_batch_split": self.micro_batch_split(),
            "paratrain": __version__,
        }
        assert weights is not None and optimizer is not None  # the main process has them
        # Copies, taken now: the steps trained while the files are written change nothing.
        files: dict[str, FileWriter] = {WEIGHTS: _safetensors_writer(detached_copy(weights))}
        for name, obj in self.parts.stateful().items():
            part = optimizer if name == "optimizer" else obj.state_dict()
            files[f"{name}.pt"] = _torch_writer(detached_copy(part))
        for rank, part in enumerate(gathered):
            files[rng_file(rank)] = _torch_writer(detached_copy(part["rng"]))
        files[STATE] = _json_writer(state)  # last: its presence marks a complete set
        run_dir, keep = self.run_dir, self.keep
        size = tensor_bytes((weights, optimizer, [g["rng"] for g in gathered]))
        if self._writer is None:
            return write_checkpoint(run_dir, step, files, keep, size)
        self._writer.submit(lambda: write_checkpoint(run_dir, step, files, keep, size))
        return run_dir / CHECKPOINTS / checkpoint_name(step)

    def wait(self) -> None:
        """Wait for the checkpoint being written; raise the error its writing ended with."""
        if self._writer is not None:
            self._writer.wait()

    @property
    def background_seconds(self) -> float:
        """Seconds spent writing checkpoints in the background so far."""
        return self._writer.seconds if self._writer is not None else 0.0


def epoch_running_loss(state: dict[str, Any], rank: int, world: int) -> tuple[float, int]:
    """This process's share of the epoch's running loss sum and samples: its own under the
    world size that saved them; under another, all of it on rank 0, summed over the ranks
    that stood for the data (a tp group's processes, or a pipeline's stages, each counted
    the same samples)."""
    sums, samples = state.get("epoch_loss_sums", [0.0]), state.get("epoch_samples", [0])
    if state["world_size"] == world:
        return float(sums[rank]), int(samples[rank])
    if rank != 0:
        return 0.0, 0
    leaders = state.get("epoch_data_leaders") or range(len(sums))
    return float(sum(sums[r] for r in leaders)), int(sum(samples[r] for r in leaders))


def load_checkpoint(
    layout: ProcessLayout, checkpoint: Path, parts: TrainingParts, batches_per_epoch: int
) -> Position:
    """Load ``checkpoint`` into ``parts`` and this process's generators; where to go on.

    Every process reads the files itself. Under another world size the generator states are
    not restored (they are per process), and the epoch's running loss sum goes to rank 0.
    """
    collective = layout.collective
    # One process reads every byte against the manifest; every process gets the verdict.
    problem = collective.broadcast_object(damage(checkpoint) if collective.is_main else None)
    if problem is not None:
        raise UserError(problem)
    state = read_state(checkpoint)
    if state["batches_per_epoch"] != batches_per_epoch:
        raise UserError(
            f"{checkpoint} was saved with {state['batches_per_epoch']} batches per epoch, this "
            f"run has {batches_per_epoch}: the data set changed; resume with the same data"
        )
    load_weights(parts.model, checkpoint / WEIGHTS)
    for name, obj in parts.stateful().items():
        path = checkpoint / f"{name}.pt"
        if path.is_file() and name == "optimizer":
            load_optimizer_state(obj, read_torch(path))
        elif path.is_file():
            obj.load_state_dict(read_torch(path))
        elif name == "optimizer":  # never reset silently: a fresh optimizer trains otherwise
            raise UserError(
                f"{path} is missing: the checkpoint cannot be resumed without its optimizer "
                "state; resume from another checkpoint"
            )
        else:  # not written: e.g. no GradScaler where the checkpoint was saved
            collective.note(f"paratrain: note: {checkpoint} holds no {name} state")
    rank, world = collective.rank, collective.world_size
    if state["world_size"] == world:
        missing = restore_rng(read_torch(checkpoint / rng_file(rank)), layout.devices)
        if missing:
            names = ", ".join(missing)
            collective.note(f"paratrain: note: no generator state restored for {names}")
    else:
        collective.note(
            f"paratrain: note: the checkpoint was saved by {state['world_size']} process(es), "
            f"this run has {world}: the data position carries over exactly, the per-process "
            "random generators do not (exact only if training draws no random numbers)"
        )
    loss_sum, count = epoch_running_loss(state, rank, world)
    return Position(
        epoch=state["epoch"],
        batch=state["batch"],
        step=state["step"],
        loss_sum=float(loss_sum),
        samples=int(count),
        metrics_lines=int(state.get("metrics_lines", 0)),
        last_metrics=dict(state.get("last_metrics") or {}),
        micro_batch_split=int(state.get("micro_batch_split", 1)),
    )


def damage(checkpoint: Path) -> str | None:
    """What is wrong with ``checkpoint`` (a missing, extra or altered file, a step that
    differs), or None when it matches its manifest. A checkpoint written before manifests
    (format 1) cannot be verified and passes."""
    try:
        state = read_state(checkpoint)
        if state["format"] < 2 and manifest.read(checkpoint) is None:
            return None
        manifest.verify(checkpoint, checkpoint_step(checkpoint))
    except (UserError, manifest.Damaged) as exc:
        return str(exc)
    except OSError as exc:
        return f"{checkpoint} cannot be read: {exc}"
    return None


def _safetensors_writer(tensors: dict[str, torch.Tensor]) -> FileWriter:
    return lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"})


def _torch_writer(obj: Any) -> FileWriter:
    return lambda tmp: torch.save(obj, tmp)


def _json_writer(obj: Any) -> FileWriter:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"

    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    return write
