"""The groups of methods the :class:`~paratrain.Runtime` facade delegates to, built around
one runtime: each reads the runtime's parts when called."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.runtime.checkpoints import RuntimeCheckpoints
from paratrain.runtime.collectives import RuntimeCollectives
from paratrain.runtime.evaluation_notes import EvaluationNotes
from paratrain.runtime.parts import RuntimeParts
from paratrain.runtime.setup import RuntimeSetup
from paratrain.runtime.step import TrainingStep
from paratrain.runtime.stop import StopOnSignal


@dataclass(frozen=True)
class MethodGroups:
    """rt.setup and rt.setup_loader; the step; the collectives; the stop on a signal;
    checkpoints; and the notes about evaluation under several processes."""

    setup: RuntimeSetup
    step: TrainingStep
    collectives: RuntimeCollectives
    stop: StopOnSignal
    checkpoints: RuntimeCheckpoints
    notes: EvaluationNotes

    @classmethod
    def of(cls, rt: RuntimeParts) -> MethodGroups:
        notes = EvaluationNotes(rt.strategy.collective, rt.strategy.data_shards)
        collectives = RuntimeCollectives(rt, notes)
        step = TrainingStep(rt)
        rt.state.on_epoch_done = step.settle
        return cls(
            setup=RuntimeSetup(rt, collectives.agree_seed, notes.loop_started, notes.tell, step),
            step=step,
            collectives=collectives,
            stop=StopOnSignal(rt),
            checkpoints=RuntimeCheckpoints(rt),
            notes=notes,
        )
