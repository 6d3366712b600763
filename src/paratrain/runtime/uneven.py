"""Ranks with different numbers of batches in a user's own loop: ``rt.join(model)``.

Under DistributedDataParallel every step all-reduces the gradients; a rank that runs out of
data first leaves the others waiting in that all-reduce until the collective timeout. Inside
``with rt.join(model):`` torch's :class:`~torch.distributed.algorithms.Join` has the ranks
that are done shadow the others' gradient all-reduces (contributing zeros) until all are
done. Each step then costs one more small all-reduce (Join counting the ranks still at
work), and the non-finite check becomes local: a rank that has finished cannot take part in
it, so a rank with a NaN loss fails alone and the launcher names it.

Loaders built by ``rt.setup_loader`` give every rank the same number of batches and need
none of this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel

from paratrain.runtime.step_state import StepState


@contextlib.contextmanager
def join_uneven(model: nn.Module, state: StepState) -> Iterator[None]:
    """``Join([model])`` for a DDP model; nothing to do for one process."""
    if not isinstance(model, DistributedDataParallel):
        yield
        return
    state.local_only = True
    try:
        with Join([model]):
            yield
    finally:
        state.local_only = False
        # each step inside was checked on its own process (one out of data agrees with
        # nobody): the ranks' step counts differ now, and nothing is left to agree on
        state.agreement.agreed_through = max(state.agreement.agreed_through, state.step)
