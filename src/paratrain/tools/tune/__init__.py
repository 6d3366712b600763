"""Hyper-parameter search on Ray Tune: ``paratrain tune``, and your own loop.

Importing this package does not import Ray; running a search does
(``pip install "paratrain[tune]"``).

    from paratrain.tools.tune import param_space, tune_function
"""

from __future__ import annotations

from paratrain.tools.tune.search import recipe_search, tune_function
from paratrain.tools.tune.settings import TuneSettings
from paratrain.tools.tune.space import Dimension, param_space, parse_space

__all__ = [
    "Dimension",
    "TuneSettings",
    "param_space",
    "parse_space",
    "recipe_search",
    "tune_function",
]
