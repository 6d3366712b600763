"""Peak memory of this process: the accelerator's allocator where there is one, else the
host's resident set."""

from __future__ import annotations

import sys

import torch


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (None where the OS does not say)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS: bytes, Linux: KiB


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated on ``device`` (CUDA), else this process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()
