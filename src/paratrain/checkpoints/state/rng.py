"""The random number generators a process draws from: captured, and restored exactly.

Python's ``random``, NumPy's global generator, torch's CPU generator and the generator of
every CUDA device the process trains on. States are stored as tensors and plain values, so
``torch.load(weights_only=True)`` reads them back.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

RngState = dict[str, Any]


def _indexed(device: torch.device) -> torch.device:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


def _cuda_devices(devices: Sequence[torch.device]) -> list[torch.device]:
    """The CUDA devices among ``devices``, once CUDA is initialized (before, no generator
    has been used: the seed alone determines their state)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(dict.fromkeys(_indexed(d) for d in devices if d.type == "cuda"))


def capture_rng(devices: Sequence[torch.device] = ()) -> RngState:
    """This process's generator states; CUDA ones for the CUDA devices in ``devices``."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: RngState = {
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    cuda = {str(d): torch.cuda.get_rng_state(d) for d in _cuda_devices(devices)}
    if cuda:
        state["cuda"] = cuda
    return state


def restore_rng(state: RngState, devices: Sequence[torch.device] = ()) -> list[str]:
    """Put the generators back to ``state``; returns the CUDA devices it could not restore
    (saved on a device this process does not train on)."""
    py = state["python"]
    internal = tuple(int(x) for x in py["internal"].tolist())
    random.setstate((int(py["version"]), internal, py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, npy["pos"], npy["has_gauss"], npy["gauss"]))
    torch.set_rng_state(state["torch"])
    missing: list[str] = []
    saved: dict[str, torch.Tensor] = state.get("cuda", {})
    if saved and torch.cuda.is_available():
        ours = {str(_indexed(d)) for d in devices if d.type == "cuda"}
        for name, value in saved.items():
            if name in ours:
                torch.cuda.set_rng_state(value, torch.device(name))
            else:
                missing.append(name)
    else:
        missing += list(saved)
    return missing
