"""The built-in strategies and recipes by name, without importing torch: `paratrain --help`
builds its parsers from here and starts in a fraction of a second. The strategy classes read
their descriptions here; tests/e2e/test_startup.py checks that the registries list these names."""

from __future__ import annotations

#: strategy name -> what it is, in the order the registry lists them
STRATEGIES = {
    "cpu": "one process on the CPU",
    "cuda": "one process on one CUDA GPU",
    "ddp": "DistributedDataParallel, one process per device (nccl on CUDA, gloo on CPU)",
    "dp": "one process, torch.nn.DataParallel over CUDA GPUs (outputs and loss on the first)",
    "dp-balanced": (
        "one process, several GPUs (or cpu,cpu); loss per device, only losses gathered"
    ),
    "fsdp": (
        "FSDP2 (fully_shard): parameters, gradients and optimizer state sharded over one "
        "process per device (nccl on CUDA, gloo on CPU)"
    ),
    "mps": "one process on an Apple GPU (MPS)",
    "pipeline": (
        "pipeline: the model's layers split into stages, one process per device, "
        "micro-batches on a 1F1B or GPipe schedule (torch.distributed.pipelining)"
    ),
}

#: the built-in recipes, in the order `paratrain recipes` lists them
RECIPES = ("digits", "linear", "cifar10-resnet18", "tiny-gpt")
