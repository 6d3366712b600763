# The same DDP script without the mistakes: doctor finds nothing.
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
    loader = DataLoader(test_set, batch_size=256, num_workers=4, pin_memory=True)
    correct = 0
    with torch.no_grad():
        for images, labels in loader:
            correct += (model(images.to(rank)).argmax(1) == labels.to(rank)).sum()
    return correct.item() / len(test_set)


def main(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    model = resnet18().to(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = DDP(model, device_ids=[rank])
    train_set = CIFAR10("data", train=True)
    sampler = DS(train_set)
    loader = DataLoader(train_set, batch_size=64, sampler=sampler, num_workers=4, pin_memory=True)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(10):
        sampler.set_epoch(epoch)
        total = torch.zeros((), device=rank)
        for step, (images, labels) in enumerate(loader):
            images = images.to(rank, non_blocking=True)
            labels = labels.to(rank, non_blocking=True)
            noise = torch.randn(images.shape, device=rank)
            loss = loss_fn(model(images + noise), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.detach()
            if step % 100 == 0 and rank == 0:
                print(f"step {step}: {loss.item():.3f}")
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch}: {total.item() / world_size:.3f}")
            torch.save(model.module.state_dict(), "checkpoint.pt")
    if dist.get_rank() == 0:
        print("accuracy", evaluate(model.module, rank))
    dist.destroy_process_group()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    mp.spawn(main, args=(world_size, free_port()), nprocs=world_size)
