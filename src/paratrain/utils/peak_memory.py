"""Peak memory of this process: the accelerator's allocator where there is one, else the
host's resident set; and the host memory still available."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


def available_host_bytes() -> int | None:
    """Memory the host can still give without swapping (Linux's ``MemAvailable``); None
    where the OS does not say."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def total_host_bytes() -> int:
    """The host's physical memory."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
