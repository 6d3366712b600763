"""One process, ``torch.nn.DataParallel`` over several CUDA GPUs (seeds 000, 004).

Each step scatters the batch over the GPUs, replicates the model, runs the replicas in
threads, gathers every output on the first GPU and computes the loss there: that device
holds more memory than the others, which ``dp-balanced`` avoids.

BatchNorm layers normalize each device's part of the batch with its own statistics, and
their running statistics come from the first device's part only (``nn.DataParallel``'s
behaviour): results depend on how the batch is split, unlike a model without BatchNorm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paratrain.devices.machine import cuda_count, parse_count, parse_device_list
from paratrain.strategies.base import Strategy, StrategyOptions
from paratrain.strategies.parallel_apply import GatherMeter, parallel_apply
from paratrain.strategies.registry import register
from paratrain.utils.catalog import STRATEGIES
from paratrain.utils.errors import UserError

CPU_HINT = (
    "to try this code path on the CPU use --strategy dp-balanced --devices cpu,cpu, "
    "or train with --strategy auto or cpu"
)


def resolve_parallel_devices(
    strategy: str, spec: str | None, *, allow_cpu: bool
) -> list[torch.device]:
    """``--devices`` for a one-process data-parallel strategy.

    No spec: every GPU. A count ``n``: ``cuda:0..n-1``. A list: those devices, repeats
    allowed (``0,1``, ``cuda:0,cuda:0``, and ``cpu,cpu`` where ``allow_cpu``).
    """
    available = cuda_count()
    count = parse_count(spec)
    if spec is None or count is not None:
        if available == 0:
            raise UserError(
                f"--strategy {strategy} needs CUDA GPUs and this machine has none; {CPU_HINT}"
            )
        wanted = available if count is None else count
        if wanted > available:
            raise UserError(
                f"--devices {count} asks for more GPUs than this machine has ({available}); "
                f"ask for at most {available}, or list devices (0,1 or cuda:0,cuda:0)"
            )
        return [torch.device("cuda", index) for index in range(wanted)]
    devices = parse_device_list(str(spec))
    kinds = {device.type for device in devices}
    if not allow_cpu and kinds != {"cuda"}:
        raise UserError(
            f"--strategy {strategy} runs on CUDA GPUs, got --devices {spec}; {CPU_HINT}"
        )
    if len(kinds) > 1 or not kinds <= {"cpu", "cuda"}:
        raise UserError(
            f"--strategy {strategy} takes CUDA GPUs or CPU entries, all of one kind "
            f"(0,1 / cuda:0,cuda:0 / cpu,cpu); got --devices {spec}"
        )
    for device in devices:
        if device.type != "cuda":
            continue
        if available == 0:
            raise UserError(f"{device} was requested but this machine has no CUDA GPU; {CPU_HINT}")
        if device.index is not None and device.index >= available:
            raise UserError(
                f"{device} does not exist: this machine has {available} CUDA device(s), "
                f"cuda:0..cuda:{available - 1}"
            )
    return [torch.device("cpu") if device.type == "cpu" else device for device in devices]


def _index(device: torch.device) -> int:
    return 0 if device.index is None else device.index


class MeteredDataParallel(nn.DataParallel[nn.Module]):
    """``nn.DataParallel`` that counts the bytes it gathers, and runs its replicas under the
    caller's autocast dtype (torch's own threads fall back to fp16 under bf16)."""

    def __init__(
        self, module: nn.Module, devices: Sequence[torch.device], meter: GatherMeter
    ) -> None:
        super().__init__(
            module, device_ids=[_index(d) for d in devices], output_device=_index(devices[0])
        )
        self.devices = list(devices)
        self.meter = meter

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.meter.reset()
        return super().forward(*inputs, **kwargs)

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any
    ) -> list[Any]:
        args = [item if isinstance(item, (list, tuple)) else (item,) for item in inputs]
        kwargs = kwargs if kwargs is not None else [{} for _ in replicas]
        return parallel_apply(replicas, args, kwargs, self.devices[: len(replicas)])

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        result = super().gather(outputs, output_device)
        self.meter.add(result)
        return result


@register
class DataParallelStrategy(Strategy):
    name = "dp"
    allows_activation_checkpointing = False
    description = STRATEGIES["dp"]

    def compile_refused(self) -> str | None:
        return (
            f"--compile does not work with --strategy {self.name}: it runs the model in "
            "threads, which torch.compile does not support; use --strategy ddp (or cuda, "
            "cpu), or drop --compile"
        )

    def __init__(self, devices: list[torch.device], options: StrategyOptions | None = None) -> None:
        super().__init__(devices, options)
        self.meter = GatherMeter()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if cuda_count() > 0 else "this machine has no CUDA GPU"

    @classmethod
    def resolve_devices(cls, spec: str | None) -> list[torch.device]:
        reason = cls.unavailable_reason()
        if reason is not None:
            raise UserError(f"--strategy {cls.name} needs CUDA GPUs: {reason}; {CPU_HINT}")
        return resolve_parallel_devices(cls.name, spec, allow_cpu=False)

    def setup_process(self) -> None:
        # Kernels launched without an explicit device go to the first GPU, DataParallel's.
        torch.cuda.set_device(self.root_device)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return MeteredDataParallel(model, self.devices, self.meter)

    def gathered_bytes_per_step(self) -> int:
        """Bytes of the outputs gathered on the first device by the last forward pass."""
        return self.meter.bytes
