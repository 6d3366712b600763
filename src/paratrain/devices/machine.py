"""What the machine offers, and turning a ``--devices`` spec into concrete devices."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from paratrain.utils.errors import UserError
from paratrain.version import __version__


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def parse_device_list(spec: str) -> list[torch.device]:
    """Parse ``0,1`` / ``cuda:0,cuda:1`` / ``cpu,cpu`` into devices (bare ints mean CUDA)."""
    devices = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            raise UserError(f"--devices {spec!r} has an empty entry; write e.g. '0,1' or 'cpu,cpu'")
        if item.isdigit():
            item = f"cuda:{item}"
        try:
            device = torch.device(item)
        except RuntimeError:
            raise UserError(
                f"--devices entry {raw.strip()!r} is not a device; use a count (2), "
                "GPU indices (0,1) or device names (cuda:0, cpu)"
            ) from None
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        devices.append(device)
    return devices


def parse_count(spec: str | int | None) -> int | None:
    """The device count if ``spec`` is a plain number, else None."""
    if spec is None:
        return None
    if isinstance(spec, int):
        count = spec
    else:
        text = spec.strip()
        if not text.lstrip("-").isdigit() or "," in text:
            return None
        count = int(text)
    if count < 1:
        raise UserError(f"--devices {spec} must be at least 1 (a count, or a list such as 0,1)")
    return count


def check_cuda_devices(devices: list[torch.device]) -> None:
    """Fail with a clear message if a CUDA device in the list does not exist here."""
    available = cuda_count()
    for device in devices:
        if device.type != "cuda":
            continue
        if available == 0:
            raise UserError(
                f"{device} was requested but this machine has no CUDA GPU; "
                "use --strategy auto or --strategy cpu"
            )
        if device.index is not None and device.index >= available:
            raise UserError(
                f"{device} does not exist: this machine has {available} CUDA device(s), "
                f"cuda:0..cuda:{available - 1}"
            )


@dataclass
class DeviceInfo:
    name: str
    type: str
    memory_bytes: int | None = None
    capability: str | None = None


@dataclass
class MachineInfo:
    python: str
    torch: str
    paratrain: str
    platform: str
    cpu_cores: int | None
    cuda_available: bool
    cuda_version: str | None
    mps_available: bool
    backends: dict[str, bool]
    devices: list[DeviceInfo] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpu_name() -> str:
    """The CPU's model name where the OS tells it (Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> MachineInfo:
    """Everything `paratrain info` reports (seed 003's queries, and a few more)."""
    devices = [DeviceInfo(name=cpu_name(), type="cpu")]
    for index in range(cuda_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            DeviceInfo(
                name=f"cuda:{index} {props.name}",
                type="cuda",
                memory_bytes=int(props.total_memory),
                capability=f"{props.major}.{props.minor}",
            )
        )
    if mps_available():
        devices.append(DeviceInfo(name="mps", type="mps"))
    backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    return MachineInfo(
        python=sys.version.split()[0],
        torch=torch.__version__,
        paratrain=__version__,
        platform=platform.platform(),
        cpu_cores=os.cpu_count(),
        cuda_available=torch.cuda.is_available(),
        cuda_version=torch.version.cuda,
        mps_available=mps_available(),
        backends=backends,
        devices=devices,
    )
