"""The 8x8 handwritten digits set, shipped inside the package so runs need no download.

``digits.npz`` holds the UCI "Optical Recognition of Handwritten Digits" data (1797
images, 8x8, values 0..16) as shipped by scikit-learn's ``load_digits``, licensed
CC BY 4.0. It was converted once; scikit-learn is not needed at run time.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import torch
from torch.utils.data import TensorDataset

N_SAMPLES = 1797
N_TEST = 360
# The split seed is fixed and separate from any run seed, so every run (and every
# device layout) is evaluated on the same held-out images.
SPLIT_SEED = 1797


def _load_arrays() -> tuple[np.ndarray, np.ndarray]:
    ref = resources.files("paratrain.data").joinpath("digits.npz")
    with ref.open("rb") as fh, np.load(fh, allow_pickle=False) as npz:
        images = np.asarray(npz["images"])
        labels = np.asarray(npz["labels"])
    return images, labels


def load_digits_split() -> tuple[TensorDataset, TensorDataset]:
    """Return (train, test): 1437 and 360 samples, images (N,1,8,8) in [0,1], int64 labels."""
    images, labels = _load_arrays()
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    train_idx, test_idx = perm[: len(y) - N_TEST], perm[len(y) - N_TEST :]
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])
