"""One seed for every random number generator a training run touches.

``Runtime(seed=N)`` and ``paratrain train --seed N`` call :func:`seed_everything`;
``Runtime()`` (``seed=None``) seeds nothing: a script's own ``torch.manual_seed`` stands.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
