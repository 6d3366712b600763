"""`paratrain doctor --explain RULE`: why a rule exists, the mistake it finds, and the fix."""

from __future__ import annotations

from paratrain.tools.doctor.rules import RULES
from paratrain.utils.errors import UserError

#: what the examples take as imported (each example, after these, shows its rule's mistake)
IMPORTS = """\
import os
import torch
from lightning.fabric import Fabric
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD
from torch.utils.data import DataLoader
from torchvision import datasets
"""

#: rule -> (why, example, fix)
_EXPLAINED: dict[str, tuple[str, str, str]] = {
    "set-epoch": (
        "DistributedSampler seeds its shuffle with the epoch it was told; without set_epoch "
        "every epoch visits the data in the same order.",
        "from torch.utils.data import DistributedSampler\n"
        "sampler = DistributedSampler(data)\nfor epoch in range(10):\n    for x, y in loader: ...",
        "sampler.set_epoch(epoch) at the start of each epoch; rt.setup_loader does it itself.",
    ),
    "ddp-without-sampler": (
        "DDP averages gradients but does not split data: without a DistributedSampler every "
        "process trains on the whole data set, the same batches N times.",
        "model = DDP(model)\nloader = DataLoader(data, batch_size=32, shuffle=True)",
        "DataLoader(data, sampler=DistributedSampler(data)), or rt.setup_loader(loader).",
    ),
    "eval-distributed-sampler": (
        "DistributedSampler pads the data so that every process gets as many samples: "
        "metrics over it count the padded duplicates.",
        "from torch.utils.data import DistributedSampler\n"
        "val = DataLoader(test_set, sampler=DistributedSampler(test_set, shuffle=False))",
        "rt.setup_loader(loader, evaluation=True) (each sample once), drop_last=True with the "
        "tail evaluated apart, or evaluate on rank 0 alone.",
    ),
    "eval-padded-loader": (
        "Fabric's setup_dataloaders and Accelerate's prepare shard loaders with padding; "
        "Accelerate's gather_for_metrics drops the duplicates, gather and Fabric's "
        "all_gather keep them.",
        "fabric = Fabric()\ntrain, test = fabric.setup_dataloaders(train, test)\n"
        "loss = fabric.all_gather(loss).sum() / len(test.dataset)",
        "accelerator.gather_for_metrics; Fabric: use_distributed_sampler=False with a sampler "
        "that does not pad; paratrain: rt.setup_loader(loader, evaluation=True).",
    ),
    "unguarded-output": (
        "Every process runs the whole script: each print comes N times, and N processes "
        "writing one file at once can leave it torn.",
        'dist.init_process_group("nccl")\nprint("epoch", epoch)\ntorch.save(state, "last.pt")',
        "if dist.get_rank() == 0: ... ; paratrain: rt.print(...), rt.save(...).",
    ),
    "rank-guard-flag": (
        "A guard such as `not args.multiprocessing_distributed or rank % ngpus == 0` holds on "
        "every process when the flag is false, which it is under torchrun: every rank saves.",
        "if args.multiprocessing_distributed:\n    mp.spawn(main_worker, nprocs=ngpus_per_node)\n"
        "...\n"
        "if not args.multiprocessing_distributed or args.rank % ngpus_per_node == 0:\n"
        "    torch.save(state, 'checkpoint.pth')",
        "test the rank itself: if dist.get_rank() == 0; paratrain: rt.save writes once.",
    ),
    "create-then-move": (
        "torch.randn(...).cuda() creates the tensor on the CPU, then copies it: two "
        "allocations and a host-to-device copy where one allocation would do.",
        "noise = torch.randn(64, 100).to(device)",
        "torch.randn(64, 100, device=device).",
    ),
    "optimizer-before-move": (
        "An optimizer built before model.to(device) may hold state for the old tensors "
        "(and, with some optimizers, the old parameters themselves).",
        "optimizer = SGD(model.parameters(), lr=0.1)\nmodel.to('cuda')",
        "move the model first, then build the optimizer; rt.setup handles either order.",
    ),
    "dataparallel-on-cpu": (
        "nn.DataParallel needs its module's parameters on device_ids[0]; around a CPU model "
        "it fails with GPUs and runs nothing in parallel without.",
        "model = Net()\nmodel = nn.DataParallel(model)",
        "nn.DataParallel(Net().to('cuda')); Runtime(strategy='dp').setup(model).",
    ),
    "wrapped-state-dict": (
        "DDP and DataParallel keep the model as .module: every key of the wrapper's "
        "state_dict() starts with 'module.', and a bare model cannot load it (KeyError).",
        "model = DDP(model)\ntorch.save({'state_dict': model.state_dict()}, 'ckpt.pt')",
        "save model.module.state_dict(); paratrain's rt.save and load_weights need no prefix.",
    ),
    "compiled-state-dict": (
        "torch.compile returns a wrapper that keeps the model as ._orig_mod: its state_dict() "
        "keys start with '_orig_mod.', and an uncompiled model cannot load them.",
        "model = torch.compile(model)\ntorch.save(model.state_dict(), 'ckpt.pt')",
        "save model._orig_mod.state_dict(); paratrain's rt.save and load_weights strip it.",
    ),
    "sync-every-step": (
        "loss.item(), .cpu() or printing a tensor makes the host wait for the device: once "
        "per step, the GPU idles while Python catches up.",
        "for x, y in loader:\n    loss = model(x.cuda()).sum()\n    loss.backward()\n"
        "    total += loss.item()",
        "total += loss.detach(); read it every N steps or once per epoch.",
    ),
    "spawn-without-main-guard": (
        "Started processes import the script again; a top-level mp.spawn then starts "
        "processes of its own.",
        "mp.spawn(main, nprocs=2)",
        'if __name__ == "__main__":\n    mp.spawn(main, nprocs=2)',
    ),
    "fixed-port": (
        "A port written in the script is the same for every run: a second run on the machine "
        "fails with EADDRINUSE, or joins the first one's group.",
        'os.environ["MASTER_PORT"] = "12355"',
        "torchrun --standalone, init_method='env://', or a free port; paratrain picks one.",
    ),
    "local-rank-as-rank": (
        "init_process_group's rank is the global rank; the local rank repeats on every "
        "machine, so on two machines two processes claim each rank.",
        'dist.init_process_group("nccl", rank=int(os.environ["LOCAL_RANK"]))',
        "rank=int(os.environ['RANK']) (torchrun sets it), or node_rank * per_node + local.",
    ),
    "loader-workers": (
        "With num_workers=0 the training process reads and decodes every batch while the "
        "GPU waits.",
        "DataLoader(datasets.ImageFolder(root), batch_size=64, pin_memory=True)",
        "num_workers=4 (a few per GPU); `paratrain bench loader` measures the best setting.",
    ),
    "loader-pin-memory": (
        "Batches in pageable memory are copied to the GPU through a staging buffer, and "
        ".to(device, non_blocking=True) cannot overlap the copy.",
        "loader = DataLoader(data, batch_size=64)\nfor x, y in loader: x = x.cuda()",
        "pin_memory=True; paratrain's rt.setup_loader pins on CUDA by itself.",
    ),
    "collective-under-guard": (
        "A collective (all_reduce, barrier, broadcast, rt.save, fabric.save, "
        "accelerator.gather...) returns only when every process made it; under a rank-0 guard "
        "the others never do, and the run hangs.",
        'dist.init_process_group("nccl")\nif rank == 0:\n    dist.all_reduce(total)\n'
        "    print(total)",
        "make the collective on every process, and guard only what follows it.",
    ),
    "metric-without-reduce": (
        "Under a sharding sampler each process sees 1/N of the data: counters summed in its "
        "loop are partial, and printing them shows one shard's figure as the whole.",
        'dist.init_process_group("nccl")\nfrom torch.utils.data import DistributedSampler\n'
        "test_loader = DataLoader(test_set, sampler=DistributedSampler(test_set))\n"
        "for x, y in test_loader:\n    correct += (model(x).argmax(1) == y).sum().item()\n"
        "print(correct / len(test_loader.dataset))",
        "dist.all_reduce the counters first (hvd.allreduce, accelerator.gather_for_metrics, "
        "rt.all_reduce with rt.setup_loader(loader, evaluation=True)).",
    ),
    "rank-as-device": (
        "RANK counts every process of every machine; a machine has LOCAL_RANK's worth of "
        "GPUs. The global rank as a device index works on one machine and fails on the "
        "second (invalid device ordinal).",
        'rank = int(os.environ["RANK"])\nlocal_rank = int(os.environ["LOCAL_RANK"])\n'
        "torch.cuda.set_device(rank)",
        "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])); paratrain sets the device itself.",
    ),
    "lan-address": (
        "An address such as 192.168.1.10 is one machine on one network: written as the "
        "rendezvous (or its default), the run waits for it anywhere else.",
        'os.environ["MASTER_ADDR"] = "192.168.1.10"',
        "take it from the launcher (torchrun sets MASTER_ADDR), default to 127.0.0.1.",
    ),
    "grad-allreduce-after-ddp": (
        "DistributedDataParallel averages the gradients during backward(); all-reducing "
        "each p.grad again costs a second round of communication, and a sum makes them N "
        "times too large.",
        "model = DDP(model)\nloss.backward()\nfor p in model.parameters():\n"
        "    dist.all_reduce(p.grad)",
        "drop the loop: DDP has done it.",
    ),
    "clip-before-unscale": (
        "GradScaler multiplies the loss, so gradients are scaled (65536 at first) until "
        "unscale_: clipping before compares the threshold with scaled norms.",
        "scaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
        "scaler.unscale_(optimizer) before clipping (paratrain: optimizer.unscale_gradients()).",
    ),
}


def explain(rule_id: str) -> str:
    """The text `--explain` prints, or a ``UserError`` naming the rules."""
    rules = {rule.id: rule for rule in RULES}
    if rule_id not in rules:
        raise UserError(f"no doctor rule {rule_id!r}; the rules: {', '.join(rules)}")
    why, example, fix = _EXPLAINED[rule_id]
    indented = "\n".join("    " + line for line in example.splitlines())
    fixed = "\n".join("    " + line for line in fix.splitlines())
    head = f"{rule_id}: {rules[rule_id].summary}"
    return f"{head}\n\nWhy: {why}\n\nExample:\n{indented}\n\nFix:\n{fixed}"


def example(rule_id: str) -> str:
    """The example of ``rule_id``'s mistake, as a script (``IMPORTS`` first)."""
    return IMPORTS + _EXPLAINED[rule_id][1]


def explained() -> set[str]:
    return set(_EXPLAINED)
