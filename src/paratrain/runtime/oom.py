"""Out of memory costs time, not the run (``Runtime(oom="auto")``, ``--oom auto``).

With ``oom="auto"``, ``rt.forward_backward`` cuts each micro-batch into ``split`` pieces
(1 at first) and runs forward and backward piece by piece, each piece's loss weighted by its
share of the micro-batch: the sum of the pieces' gradients is the micro-batch's gradient, so
a step with pieces is the same step (the same global batch), only slower.

After each piece's forward, before its backward, every process joins one small all-reduce
saying whether it ran out of memory (the step's agreement, which also carries the
non-finite check and the stop: :mod:`paratrain.runtime.agreement`); a process that did still
joins it, so no process waits in another collective. If any did, every process drops that piece
(its forward touched no gradient), restores what the forward changed (random generators,
BatchNorm statistics), doubles ``split`` and redoes the rest of the micro-batch with pieces
half as large. The main process notes it once; the loop saves ``split`` in its checkpoints
and reports the micro-batch in its summary. A run of one process needs no all-reduce.

What cannot be redone safely, said in one message instead of a hang:

* a micro-batch already of one sample per process (nothing left to halve);
* an out-of-memory error inside the backward pass when gradients were already there (earlier
  pieces or micro-batches of the step) or when the backward communicates (ddp's gradient
  all-reduce, fsdp's gathers and reduce-scatters): the other processes are then inside a
  collective that the failed one never joins;
* an error inside fsdp's forward, between its parameter gathers (the same reason); an error
  at the end of fsdp's forward (the activations' peak) is recovered like any other;
* ``pipeline``, whose schedule already cuts batches into micro-batches
  (``--pipeline-microbatches``).

Without a GPU to run out of, a test registers a handler for the ``oom`` fault injection
point (:mod:`paratrain.utils.injection`), reached at the end of each piece's forward under
``--oom auto``: raising ``torch.OutOfMemoryError`` there is running out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paratrain.distributed.collective import Collective
from paratrain.utils import injection
from paratrain.utils.errors import LaunchError, UserError

OOM_MODES = ("auto", "off")


class OutOfMemoryStop(LaunchError):
    """Running out of memory where the step cannot be redone; the message says why, in one
    line (exit code 1, no traceback: what the user changes is the batch, the precision or
    the layout, not the code the traceback would show)."""


def check_oom_mode(mode: str) -> str:
    if mode not in OOM_MODES:
        raise UserError(f"--oom {mode!r}: use one of {', '.join(OOM_MODES)}")
    return mode


#: ``test_hook(rank, samples, step)``: the ``oom`` fault injection point, under the name the
#: OOM step calls it by
test_hook = injection.oom


def batch_length(batch: Any) -> int:
    """Samples in a batch (a tensor, or nested tuples, lists and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_length(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_length(next(iter(batch.values())))
    raise UserError("--oom auto cuts batches along their first dimension: pass tensors")


def cut(batch: Any, start: int, end: int) -> Any:
    """Samples ``start:end`` of every tensor in ``batch``."""
    if isinstance(batch, torch.Tensor):
        return batch[start:end]
    if isinstance(batch, (list, tuple)):
        return type(batch)(cut(item, start, end) for item in batch)
    if isinstance(batch, dict):
        return {key: cut(value, start, end) for key, value in batch.items()}
    return batch


@dataclass
class Snapshot:
    """What a forward changes besides the autograd graph: the random generators and the
    running statistics of normalization layers."""

    cpu_rng: torch.Tensor
    device_rng: torch.Tensor | None
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def take(cls, model: nn.Module, device: torch.device) -> Snapshot:
        device_rng = None
        if device.type == "cuda":
            device_rng = torch.cuda.get_rng_state(device)
        # only normalization statistics change in a forward; other buffers (masks, caches)
        # may be large and are left alone
        norms = [m for m in model.modules() if isinstance(m, _NORMS)]
        buffers = [(b, b.detach().clone()) for m in norms for b in m.buffers(recurse=False)]
        return cls(torch.get_rng_state(), device_rng, buffers)

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.device_rng is not None:
            torch.cuda.set_rng_state(self.device_rng, device)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)


_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


class MicroBatches:
    """How many pieces each micro-batch is cut into, and the agreement on running out."""

    def __init__(self, mode: str = "off") -> None:
        self.mode = check_oom_mode(mode)
        #: whether micro-batches are cut and redone on running out (``--oom auto``); a plain
        #: attribute: every step asks
        self.active = self.mode == "auto"
        #: pieces per micro-batch (a power of two); checkpoints remember it
        self.split = 1
        #: samples per process of a piece after the last halving (None: never halved)
        self.piece_samples: int | None = None
        #: the optimizer step (1-based) at which the micro-batch was last halved
        self.halved_at: int | None = None

    def failed_ranks(self, collective: Collective, failed: bool) -> list[int]:
        """After the step's agreement said that a process ran out of memory
        (:mod:`paratrain.runtime.agreement`): which ones (a second collective, rare)."""
        if collective.world_size == 1:
            return [collective.rank]
        flags = collective.all_gather(torch.tensor([failed], dtype=torch.uint8))
        return [rank for rank, flag in enumerate(flags) if bool(flag)]

    def halve(self, collective: Collective, ranks: list[int], samples: int, step: int) -> None:
        """Double ``split`` after ``ranks`` ran out with pieces of ``samples`` samples."""
        if samples <= 1:
            raise OutOfMemoryStop(
                f"out of memory on rank(s) {_names(ranks)} at step {step} with one sample per "
                "process: nothing left to halve; use --precision bf16, --strategy fsdp, more "
                "devices or a smaller model"
            )
        self.split *= 2
        self.piece_samples = max(1, samples // 2)
        self.halved_at = step
        collective.note(
            f"paratrain: note: out of memory on rank(s) {_names(ranks)} at step {step} with "
            f"{samples} samples per process; every process now cuts each micro-batch into "
            f"{self.split} pieces (about {self.piece_samples} samples each): the same global "
            "batch, more time per step"
        )

    def describe(self) -> dict[str, Any]:
        return {"oom": self.mode, "micro_batch_split": self.split}


def _names(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)
