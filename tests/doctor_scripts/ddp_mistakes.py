# A DDP script with the classic mistakes; the comment at the end of a line names its findings.
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as DS
from torchvision.datasets import CIFAR10
from torchvision.models import resnet18


def evaluate(model, rank):
    test_set = CIFAR10("data", train=False)
    loader = DataLoader(test_set, batch_size=256, sampler=DS(test_set), num_workers=4, pin_memory=True)  # expect: eval-distributed-sampler
    correct = 0
    with torch.no_grad():
        for images, labels in loader:
            correct += (model(images.to(rank)).argmax(1) == labels.to(rank)).sum()
    return correct


def main(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "12355"  # expect: fixed-port
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    model = resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to(rank)  # expect: optimizer-before-move
    model = DDP(model, device_ids=[rank])
    train_set = CIFAR10("data", train=True)
    sampler = DS(train_set)  # expect: set-epoch
    loader = DataLoader(train_set, batch_size=64, sampler=sampler)  # expect: loader-workers, loader-pin-memory
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(10):
        total = 0.0
        for images, labels in loader:
            images, labels = images.to(rank), labels.to(rank)
            noise = torch.randn(images.shape).to(rank)  # expect: create-then-move
            loss = loss_fn(model(images + noise), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()  # expect: sync-every-step
        print(f"epoch {epoch}: {total:.3f}")  # expect: unguarded-output
        torch.save(model.state_dict(), "checkpoint.pt")  # expect: unguarded-output, wrapped-state-dict
    print("accuracy", evaluate(model, rank))  # expect: unguarded-output
    dist.destroy_process_group()


world_size = torch.cuda.device_count()
mp.spawn(main, args=(world_size,), nprocs=world_size)  # expect: spawn-without-main-guard
