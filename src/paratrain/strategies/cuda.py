"""Train on one CUDA GPU in one process (`--devices 1`: cuda:0, `--devices cuda:3`: that one)."""

from __future__ import annotations

import torch

from paratrain.devices.machine import check_cuda_devices, cuda_count
from paratrain.strategies.registry import register
from paratrain.strategies.single import SingleDeviceStrategy
from paratrain.utils.catalog import STRATEGIES


@register
class CUDAStrategy(SingleDeviceStrategy):
    name = "cuda"
    compile_mode = "reduce-overhead"  # one launch-bound GPU: CUDA graphs pay
    description = STRATEGIES["cuda"]
    device_type = "cuda"

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device("cuda", 0)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if cuda_count() > 0 else "this machine has no CUDA GPU"

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        check_cuda_devices([device])

    def setup_process(self) -> None:
        # Kernels launched without an explicit device go to ours, not to cuda:0.
        torch.cuda.set_device(self.root_device)
