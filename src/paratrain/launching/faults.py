"""The step's fault injection point, under the name the step calls it by.

``faults.at_step(rank, step, loss)`` runs before each micro-batch's backward: a plug-in may
make the rank fail there as clusters do (killed, stalled, a NaN loss, a stop signal); without
one it returns ``loss`` as it is. The points and their plug-ins: :mod:`paratrain.utils.injection`.
"""

from __future__ import annotations

from paratrain.utils import injection

at_step = injection.at_step
