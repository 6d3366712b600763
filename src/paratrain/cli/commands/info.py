"""`paratrain info`: what this machine offers (seed 003's queries, and more)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "info",
        help="what this machine offers",
        description="The versions of paratrain, torch and Python, the CPU cores, CUDA and "
        "MPS, the distributed backends, and every device with its memory.",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from paratrain.devices.machine import machine_info

    info = machine_info()
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    print(f"paratrain {info.paratrain}, torch {info.torch}, python {info.python}")
    print(f"platform: {info.platform}; CPU cores: {info.cpu_cores}")
    cuda = f"yes (CUDA {info.cuda_version})" if info.cuda_available else "no"
    print(f"CUDA available: {cuda}; MPS available: {'yes' if info.mps_available else 'no'}")
    backends = ", ".join(name for name, ok in info.backends.items() if ok) or "none"
    print(f"distributed backends: {backends}")
    for device in info.devices:
        memory = f", {device.memory_bytes / 2**30:.1f} GiB" if device.memory_bytes else ""
        capability = f", capability {device.capability}" if device.capability else ""
        print(f"  {device.type}: {device.name}{memory}{capability}")
    return 0
