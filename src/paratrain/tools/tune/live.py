"""The live table as a Ray Tune callback (this module imports Ray: import it lazily)."""

from __future__ import annotations

from ray.tune import Callback

from paratrain.tools.tune.display import LiveTrials


class LiveTrialsCallback(LiveTrials, Callback):
    """Redraws the table of trials on stderr at every start, result, end and failure."""
