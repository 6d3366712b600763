"""What the loader's ``batch_size`` means: the global batch, or each process's batch.

paratrain's default is the global batch: every layout then sees the same batches and
computes the same model. Scripts ported from DDP, Horovod or Accelerate mean the batch of
one process instead, so that their effective batch grows with the number of processes;
``batch_size_per="process"`` keeps that meaning.

A process, not a device: ``dp`` and ``dp-balanced`` run one process that splits its batch
over its devices, exactly as an ``nn.DataParallel`` script does, so there the two meanings
agree (one data shard).
"""

from __future__ import annotations

from paratrain.utils.errors import UserError

#: the accepted values of ``batch_size_per`` / ``--batch-size-per``
BATCH_SIZE_PER = ("global", "process")


def check_batch_size_per(value: str) -> str:
    """``value`` if it is one of :data:`BATCH_SIZE_PER`, else ``UserError``."""
    if value not in BATCH_SIZE_PER:
        raise UserError(f"batch_size_per must be one of {', '.join(BATCH_SIZE_PER)}, got {value!r}")
    return value


def global_batch_size(batch_size: int, per: str, data_shards: int) -> int:
    """The global batch for a loader of ``batch_size`` when the data is cut into
    ``data_shards`` parts (one per process)."""
    return batch_size * data_shards if check_batch_size_per(per) == "process" else batch_size
