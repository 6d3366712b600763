"""Model FLOPs utilisation: the FLOPs a training step does, against what the device can do.

The FLOPs are counted once per model with torch's ``FlopCounterMode`` on a copy of the model
on the meta device (no memory, no real work, the model and the random generators
untouched): forward, loss and backward of one batch. The peak is the device's dense
figure for the precision from :data:`PEAK_TFLOPS` (dense, not the 2:4-sparse figure that
datasheets print beside it and some tables mix up); a GPU missing from the table, and the
CPU, get a peak measured by a matmul probe, marked as such.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

#: dense TFLOP/s per GPU model: (bf16, fp16, fp32) with fp32 the plain (non-TF32) rate;
#: None: not in the table (measured). Looked up by substring of ``torch.cuda.get_device_name``,
#: first match wins: the more specific names first (H100 PCIe before H100, L40S before L4).
PEAK_TFLOPS: tuple[tuple[str, tuple[float | None, float, float] | None], ...] = (
    ("H100 PCIe", (756.0, 756.0, 51.2)),
    ("H100 NVL", None),
    ("GH200", (989.4, 989.4, 66.9)),
    ("H100", (989.4, 989.4, 66.9)),  # SXM
    ("H200", (989.4, 989.4, 66.9)),
    ("A100", (312.0, 312.0, 19.5)),
    ("L40S", (362.0, 362.0, 91.6)),
    ("L40", (181.0, 181.0, 90.5)),
    ("L4", (121.0, 121.0, 30.3)),
    ("A10G", None),
    ("A10", (125.0, 125.0, 31.2)),
    ("RTX 4090", (165.2, 165.2, 82.6)),
    ("V100", (None, 125.0, 15.7)),
    ("T4", (None, 65.0, 8.1)),
)
_COLUMN = {"bf16": 0, "fp16": 1, "32": 2}
_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "32": torch.float32}


@dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s for one precision, and where the figure comes from."""

    flops_per_second: float
    #: "table" (the datasheet's dense figure) or "matmul probe" (measured here)
    source: str
    device: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def table_peak(name: str, precision: str) -> float | None:
    """The dense FLOP/s of the GPU called ``name`` in ``precision`` (32, bf16, fp16)."""
    for fragment, figures in PEAK_TFLOPS:
        if fragment.lower() in name.lower():
            tflops = None if figures is None else figures[_COLUMN[precision]]
            return None if tflops is None else tflops * 1e12
    return None


def matmul_probe(device: torch.device, precision: str, size: int = 0, repeats: int = 10) -> float:
    """FLOP/s of the best of ``repeats`` square matmuls on ``device`` (2 n^3 each)."""
    size = size or (512 if device.type == "cpu" else 4096)
    dtype = _DTYPE[precision]
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # no fast fp16 matmul on CPUs: autocast runs bf16 there
    a = torch.ones(size, size, dtype=dtype, device=device)  # no random draw
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, a)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-12)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_of(device: torch.device, precision: str) -> Peak:
    """The device's dense peak for ``precision``: the table, else a matmul probe."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        flops = table_peak(name, precision)
        if flops is not None:
            return Peak(flops, "table", name)
    else:
        name = device.type
    return Peak(matmul_probe(device, precision), "matmul probe", name)


def _meta(value: Any) -> Any:
    """``value`` with every tensor in it on the meta device."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    return value


def training_flops(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any
) -> int | None:
    """FLOPs of forward, loss and backward of ``model`` on this batch (None where the model
    cannot be copied to the meta device, e.g. sharded parameters)."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        memo: dict[int, Any] = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            empty = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, nn.Parameter):
                empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = empty
        ghost = copy.deepcopy(model, memo)
        for module in ghost.modules():  # the runtime's guards wrap the original's forward
            module.__dict__.pop("forward", None)
        with torch.random.fork_rng(devices=[]), FlopCounterMode(display=False) as counter:
            loss = loss_fn(ghost(_meta(inputs)), _meta(targets))
            if loss.requires_grad:
                loss.backward()
        return int(counter.get_total_flops())
    except Exception:  # counting is a courtesy: a model it cannot copy trains all the same
        return None
