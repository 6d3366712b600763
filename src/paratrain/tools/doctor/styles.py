"""Which kind of training script this is, and which page of the manual ports it."""

from __future__ import annotations

from paratrain.tools.doctor.findings import Style
from paratrain.tools.doctor.names import DATA_PARALLEL
from paratrain.tools.doctor.ranks import starts_group
from paratrain.tools.doctor.script import Script

PORTING = "docs/porting.md"

PARATRAIN = Style("paratrain", "a paratrain script", "docs/your-own-loop.md")
ACCELERATE = Style(
    "accelerate", "a Hugging Face Accelerate script", f'{PORTING}, "From Accelerate"'
)
FABRIC = Style("fabric", "a Lightning Fabric script", f'{PORTING}, "From Lightning Fabric"')
HOROVOD = Style("horovod", "a Horovod script", f'{PORTING}, "From Horovod"')
DDP_SCRIPT = Style(
    "ddp", "a DistributedDataParallel script", f'{PORTING}, "From DistributedDataParallel"'
)
FSDP = Style("fsdp", "an FSDP / tensor-parallel script", "docs/strategies/fsdp.md")
DEEPSPEED = Style("deepspeed", "a DeepSpeed script", f'{PORTING}, "From DistributedDataParallel"')
DATAPARALLEL = Style("dataparallel", "an nn.DataParallel script", f'{PORTING}, "From DataParallel"')
PLAIN = Style("plain", "a plain PyTorch loop", f'{PORTING}, "From a plain loop"')


#: modules of sharded and tensor-parallel training
_SHARDING = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
)


def detect(script: Script) -> Style:
    """The most specific style first: a DDP script that imports paratrain is being ported."""
    if script.uses("paratrain"):
        return PARATRAIN
    if script.uses("accelerate"):
        return ACCELERATE
    if script.uses("lightning_fabric") or script.uses("lightning"):
        return FABRIC
    if script.uses("horovod"):
        return HOROVOD
    if script.uses("deepspeed"):
        return DEEPSPEED
    if any(script.uses(m) for m in _SHARDING):
        return FSDP
    if starts_group(script):
        return DDP_SCRIPT  # processes started here, or by a local module it imports
    if any(True for _ in script.calls(DATA_PARALLEL)):
        return DATAPARALLEL
    return PLAIN
