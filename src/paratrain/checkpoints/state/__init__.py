"""Training state that survives a crash: checkpoints of the training loop, ``rt.save`` /
``rt.load`` for users' own loops, and ``paratrain train --resume``.

A resumed run ends with the same weights, bit for bit, as one that never stopped (on the CPU
in fp32, same layout): the model, optimizer, LR scheduler and GradScaler states, the step
counters, the data position (epoch, and global batch inside it) and every process's random
generators all come back.

``paratrain train --resume`` itself (which run, which settings) lives in
:mod:`paratrain.training.resume`, above the training configuration.
"""

from __future__ import annotations

from paratrain.checkpoints.state.group import GroupPosition
from paratrain.checkpoints.state.rng import capture_rng, restore_rng
from paratrain.checkpoints.state.sharded import save_model_weights
from paratrain.checkpoints.state.snapshot import (
    Checkpointer,
    Position,
    ProcessLayout,
    TrainingParts,
    load_checkpoint,
    read_state,
)
from paratrain.checkpoints.state.store import (
    CHECKPOINTS,
    latest_checkpoint,
    list_checkpoints,
    remove_checkpoints,
)
from paratrain.checkpoints.state.user import load_state, save_state

__all__ = [
    "CHECKPOINTS",
    "Checkpointer",
    "GroupPosition",
    "Position",
    "ProcessLayout",
    "TrainingParts",
    "capture_rng",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_state",
    "read_state",
    "remove_checkpoints",
    "restore_rng",
    "save_model_weights",
    "save_state",
]
