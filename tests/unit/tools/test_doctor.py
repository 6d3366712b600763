"""`paratrain doctor`: every rule finds its mistake, and its near miss is clean.

Each case is a small script; a line's ``# expect: rule-id`` comment names the findings it
must produce. A case must produce exactly those (no other rule, no other line), and a
script without any ``# expect:`` must produce none.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from paratrain.cli.main import main
from paratrain.tools.doctor import RULES, diagnose, diagnose_source

SCRIPTS = Path(__file__).parents[2] / "doctor_scripts"
EXPECT = re.compile(r"#\s*expect:\s*([^#]+)")


def expected(source: str) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(source.splitlines(), start=1):
        if match := EXPECT.search(line):
            found += [(number, rule.strip()) for rule in match.group(1).strip().split(",")]
    return sorted(found)


def found(source: str) -> list[tuple[int, str]]:
    return [(f.line, f.rule) for f in diagnose_source(textwrap.dedent(source)).findings]


# (rule, script with the mistake, near misses that must be clean)
CASES: list[tuple[str, str, list[str]]] = [
    (
        "set-epoch",
        """
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler
        sampler = DistributedSampler(train_set)  # expect: set-epoch
        loader = DataLoader(train_set, sampler=sampler)
        for epoch in range(3):
            for x in loader:
                pass
        """,
        [
            """
            from torch.utils.data import DataLoader, DistributedSampler
            sampler = DistributedSampler(train_set)
            loader = DataLoader(train_set, sampler=sampler)
            for epoch in range(3):
                loader.sampler.set_epoch(epoch)
                for x in loader:
                    pass
            """,
            """
            from torch.utils.data import DistributedSampler
            sampler = DistributedSampler(train_set, shuffle=False)
            """,
        ],
    ),
    (
        "ddp-without-sampler",
        """
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader
        model = DistributedDataParallel(net)
        loader = DataLoader(data, batch_size=32)  # expect: ddp-without-sampler
        for x, y in loader:
            model(x).sum().backward()
        """,
        [
            """
            from torch.nn.parallel import DistributedDataParallel
            from torch.utils.data import DataLoader
            model = DistributedDataParallel(net)
            outputs = [model(x) for x, in DataLoader(data, batch_size=32)]
            """,
            """
            from torch.utils.data import DataLoader
            loader = DataLoader(data, batch_size=32, shuffle=True)
            for x, y in loader:
                model(x).sum().backward()
            """,
        ],
    ),
    (
        "eval-distributed-sampler",
        """
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler as DS
        val = DataLoader(data, sampler=DS(data, shuffle=False))  # expect: eval-distributed-sampler
        """,
        [
            """
            from torch.utils.data import DataLoader
            from torch.utils.data.distributed import DistributedSampler as DS
            train_loader = DataLoader(data, sampler=DS(data, shuffle=False))
            """,
        ],
    ),
    (
        "unguarded-output",
        """
        import logging
        import torch
        import torch.distributed as dist
        log = logging.getLogger(__name__)
        dist.init_process_group("gloo")
        for epoch in range(3):
            print("epoch", epoch)  # expect: unguarded-output
            log.info("epoch %d", epoch)  # expect: unguarded-output
            torch.save(state, "last.pt")  # expect: unguarded-output
        """,
        [
            """
            import torch
            import torch.distributed as dist
            dist.init_process_group("gloo")
            rank = dist.get_rank()
            for epoch in range(3):
                print(f"rank {rank}: epoch {epoch}")
                if rank == 0:
                    print("epoch", epoch)
                    torch.save(state, "last.pt")
            """,
            """
            import torch.distributed as dist
            def report(epoch):
                if not dist.get_rank() == 0:
                    return
                print(epoch)
            def log(message):
                print(message)
            dist.init_process_group("gloo")
            report(1)
            if dist.get_rank() == 0:
                log("done")
            """,
            """
            import torch.multiprocessing as mp
            def main(rank):
                pass
            if __name__ == "__main__":
                mp.spawn(main, nprocs=2)
                print("all processes finished")
            """,
            """
            from accelerate import Accelerator
            accelerator = Accelerator()
            accelerator.print("once")
            if accelerator.is_main_process:
                print("once too")
            """,
            """
            for epoch in range(3):
                print("epoch", epoch)
            """,
        ],
    ),
    (
        "create-then-move",
        """
        import torch
        x = torch.zeros(3).cuda()  # expect: create-then-move
        for step in range(10):
            noise = torch.randn(3, 3).to(device)  # expect: create-then-move
        """,
        [
            """
            import torch
            x = torch.zeros(3, device="cuda")
            y = torch.zeros(3).to(torch.float16)
            for batch in loader:
                batch = batch.to(device)
            """,
        ],
    ),
    (
        "optimizer-before-move",
        """
        import torch
        def build():
            model = torch.nn.Linear(2, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model.to("cuda")  # expect: optimizer-before-move
        """,
        [
            """
            import torch
            model = torch.nn.Linear(2, 1)
            model.to("cuda")
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            other.to("cuda")
            model.to(torch.float64)
            """,
        ],
    ),
    (
        "dataparallel-on-cpu",
        """
        from torch import nn
        model = nn.DataParallel(nn.Linear(2, 1))
        net = nn.Linear(2, 1)
        net = nn.DataParallel(net)  # expect: dataparallel-on-cpu
        """,
        [
            """
            from torch import nn
            net = nn.Linear(2, 1)
            net = nn.DataParallel(net).cuda()
            model = nn.Linear(2, 1).to(device)
            model = nn.DataParallel(model, device_ids=[0, 1])
            """,
        ],
    ),
    (
        "wrapped-state-dict",
        """
        import torch
        from torch import nn
        model = nn.DataParallel(net.cuda())
        torch.save(model.state_dict(), "model.pt")  # expect: wrapped-state-dict
        state = {"model": model.state_dict(), "step": 3}
        torch.save(state, "model.pt")  # expect: wrapped-state-dict
        """,
        [
            """
            import torch
            from torch import nn
            model = nn.DataParallel(net.cuda())
            torch.save(model.module.state_dict(), "model.pt")
            model = model.module
            torch.save(model.state_dict(), "model.pt")
            """,
            """
            import torch
            from accelerate import Accelerator
            accelerator = Accelerator()
            optimizer = torch.optim.SGD(model.parameters())
            model, optimizer = accelerator.prepare(model, optimizer)
            accelerator.save(optimizer.state_dict(), "optimizer.pt")
            accelerator.save(accelerator.unwrap_model(model).state_dict(), "model.pt")
            """,
        ],
    ),
    (
        "sync-every-step",
        """
        import torch
        model = torch.nn.Linear(2, 1).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        total = 0.0
        for x, y in loader:
            out = model(x)
            loss = ((out - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            total += loss.item()  # expect: sync-every-step
            print(out)  # expect: sync-every-step
        """,
        [
            """
            import torch
            model = torch.nn.Linear(2, 1).cuda()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for step, (x, y) in enumerate(loader):
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                optimizer.step()
                if step % 100 == 0:
                    print(loss.item())
            print(loss.item())
            """,
            """
            import torch
            model = torch.nn.Linear(2, 1)
            for x, y in loader:
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                print(loss.item())
            """,
        ],
    ),
    (
        "spawn-without-main-guard",
        """
        import torch.multiprocessing as mp
        def main(rank):
            pass
        def run():
            mp.spawn(main, nprocs=2)
        mp.spawn(main, nprocs=2)  # expect: spawn-without-main-guard
        run()  # expect: spawn-without-main-guard
        """,
        [
            """
            import torch.multiprocessing as mp
            def main(rank):
                pass
            def run():
                mp.spawn(main, nprocs=2)
            if __name__ == "__main__":
                run()
            """,
            """
            def spawn(fn, nprocs):
                fn(0)
            spawn(print, nprocs=2)
            """,
        ],
    ),
    (
        "fixed-port",
        """
        import os
        import torch.distributed as dist
        PORT = 29500
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:23456")  # expect: fixed-port
        dist.init_process_group("gloo", init_method=f"tcp://localhost:{PORT}")  # expect: fixed-port
        os.environ["MASTER_PORT"] = "12355"  # expect: fixed-port
        """,
        [
            """
            import os
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method="env://")
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}")
            dist.init_process_group("gloo", init_method="tcp://node0.cluster:23456")
            os.environ["MASTER_PORT"] = str(free_port())
            """,
        ],
    ),
    (
        "loader-workers",
        """
        from torch.utils.data import DataLoader
        from torchvision import datasets
        images = datasets.ImageFolder("train")
        loader = DataLoader(images, batch_size=64, pin_memory=True)  # expect: loader-workers
        for x in loader:
            x = x.cuda(non_blocking=True)
        """,
        [
            """
            from torch.utils.data import DataLoader, TensorDataset
            loader = DataLoader(TensorDataset(x, y), batch_size=64)
            for x in loader:
                x = x.cuda()
            """,
            """
            from torch.utils.data import DataLoader
            loader = DataLoader(images, batch_size=64)
            """,
        ],
    ),
    (
        "collective-under-guard",
        """
        import torch
        import torch.distributed as dist
        import paratrain
        dist.init_process_group("gloo")
        rt = paratrain.Runtime(strategy="ddp")
        total = torch.zeros(1)
        if dist.get_rank() == 0:
            dist.all_reduce(total)  # expect: collective-under-guard
        if rt.is_main:
            rt.save("last.pt", {"step": 1})  # expect: collective-under-guard
        def report(value):
            dist.barrier()
        def finish():
            if dist.get_rank() != 0:
                return
            report(total)  # expect: collective-under-guard
        """,
        [
            """
            import torch
            import torch.distributed as dist
            import paratrain
            dist.init_process_group("gloo")
            rt = paratrain.Runtime(strategy="ddp")
            total = torch.zeros(1)
            dist.all_reduce(total)
            rt.save("last.pt", {"step": 1})
            if dist.get_rank() == 0:
                print(total)
            if not distributed or dist.get_rank() == 0:
                dist.barrier()
            if args.local_rank == -1:
                dist.barrier()
            """,
        ],
    ),
    (
        "metric-without-reduce",
        """
        import torch
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler
        dist.init_process_group("gloo")
        sampler = DistributedSampler(test_set, shuffle=False, drop_last=True)
        test_loader = DataLoader(test_set, sampler=sampler)
        def evaluate(model):
            correct, total = 0, 0
            with torch.no_grad():
                for x, y in test_loader:
                    correct += (model(x).argmax(1) == y).sum().item()
                    total += len(y)
            accuracy = correct / total
            print(f"accuracy {accuracy:.3f}")  # expect: metric-without-reduce
        """,
        [
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler
            dist.init_process_group("gloo")
            sampler = DistributedSampler(test_set, shuffle=False, drop_last=True)
            test_loader = DataLoader(test_set, sampler=sampler)
            def evaluate(model):
                correct = torch.zeros(1)
                with torch.no_grad():
                    for x, y in test_loader:
                        correct += (model(x).argmax(1) == y).sum()
                dist.all_reduce(correct)
                print(f"correct {correct.item()}")
            def train(model):
                total = 0.0
                for x, y in test_loader:
                    loss = model(x).sum()
                    loss.backward()
                    total += loss.item()
                print(total)
            """,
            """
            import paratrain
            def main(rt):
                loader = rt.setup_loader(test_loader, evaluation=True)
                correct = 0
                for x, y in loader:
                    correct += (model(x).argmax(1) == y).sum()
                rt.print(rt.all_reduce(correct))
            rt = paratrain.Runtime(strategy="ddp")
            if __name__ == "__main__":
                rt.launch(main)
            loader = rt.setup_loader(test_loader, evaluation=True)
            correct = 0
            for x, y in loader:
                correct += (model(x).argmax(1) == y).sum()
            rt.print(rt.all_reduce(correct))
            """,
        ],
    ),
    (
        "rank-guard-flag",
        """
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp
        def save_checkpoint(state, filename="checkpoint.pt"):
            torch.save(state, filename)
        def worker(gpu, args):
            dist.init_process_group("nccl", rank=args.rank)
            if not args.multiprocessing_distributed or args.rank % 8 == 0:
                save_checkpoint({"epoch": 1})  # expect: rank-guard-flag
        if __name__ == "__main__":
            if args.multiprocessing_distributed:
                mp.spawn(worker, nprocs=8, args=(args,))
            else:
                worker(args.gpu, args)
        """,
        [
            """
            import torch
            import torch.distributed as dist
            import torch.multiprocessing as mp
            def worker(gpu, args):
                dist.init_process_group("nccl", rank=args.rank)
                if not args.distributed or dist.get_rank() == 0:
                    torch.save({"epoch": 1}, "checkpoint.pt")
            if __name__ == "__main__":
                if args.multiprocessing_distributed:
                    mp.spawn(worker, nprocs=8, args=(args,))
                else:
                    worker(args.gpu, args)
            """,
        ],
    ),
    (
        "compiled-state-dict",
        """
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = GPT(config)
        if compile:
            model = torch.compile(model)
        if ddp:
            model = DDP(model, device_ids=[0])
        raw_model = model.module if ddp else model
        checkpoint = {"model": raw_model.state_dict(), "iter": 1}
        if master_process:
            torch.save(checkpoint, "ckpt.pt")  # expect: compiled-state-dict
        """,
        [
            """
            import torch
            model = GPT(config)
            compiled = torch.compile(model)
            torch.save(model.state_dict(), "ckpt.pt")
            torch.save(compiled._orig_mod.state_dict(), "ckpt.pt")
            model.compile()
            torch.save(model.state_dict(), "ckpt.pt")
            """,
        ],
    ),
    (
        "clip-before-unscale",
        """
        import torch
        scaler = torch.cuda.amp.GradScaler()
        for x, y in loader:
            scaler.scale(model(x).sum()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: clip-before-unscale
            scaler.step(optimizer)
            scaler.update()
        """,
        [
            """
            import torch
            scaler = torch.amp.GradScaler("cuda")
            for x, y in loader:
                if use_amp:
                    scaler.scale(model(x).sum()).backward()
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(optimizer)
                else:
                    model(x).sum().backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
            """,
        ],
    ),
    (
        "local-rank-as-rank",
        """
        import os
        import torch.distributed as dist
        local_rank = int(os.environ["LOCAL_RANK"])
        dist.init_process_group("nccl", rank=local_rank)  # expect: local-rank-as-rank
        dist.init_process_group("nccl", rank=args.local_rank)  # expect: local-rank-as-rank
        """,
        [
            """
            import os
            import torch.distributed as dist
            import torch.multiprocessing as mp
            def main(local_rank, world_size):
                dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
            dist.init_process_group("nccl", rank=int(os.environ["RANK"]), world_size=8)
            if __name__ == "__main__":
                mp.spawn(main, nprocs=2, args=(2,))
            """,
        ],
    ),
    (
        "eval-padded-loader",
        """
        import lightning as L
        fabric = L.Fabric(devices=2)
        train, test_loader = fabric.setup_dataloaders(a, test_loader)  # expect: eval-padded-loader
        """,
        [
            """
            import lightning as L
            fabric = L.Fabric(devices=2)
            train_loader = fabric.setup_dataloaders(train_loader)
            test_loader = fabric.setup_dataloaders(test_loader, use_distributed_sampler=False)
            """,
            """
            from accelerate import Accelerator
            accelerator = Accelerator()
            model, eval_dataloader = accelerator.prepare(model, eval_dataloader)
            for batch in eval_dataloader:
                predictions = accelerator.gather_for_metrics(model(batch))
            """,
        ],
    ),
    (
        "loader-pin-memory",
        """
        from torch.utils.data import DataLoader
        loader = DataLoader(images, batch_size=64, num_workers=4)  # expect: loader-pin-memory
        for x in loader:
            x = x.to("cuda")
        """,
        [
            """
            from torch.utils.data import DataLoader
            import paratrain
            rt = paratrain.Runtime(strategy="cuda")
            loader = rt.setup_loader(DataLoader(images, batch_size=64, num_workers=4))
            """,
        ],
    ),
    (
        "rank-as-device",
        """
        import os
        import torch
        import torch.distributed as dist
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ["LOCAL_RANK"])
        dist.init_process_group("nccl")
        torch.cuda.set_device(rank)  # expect: rank-as-device
        """,
        [
            """
            import os
            import torch
            import torch.distributed as dist
            local_rank = int(os.environ["LOCAL_RANK"])
            dist.init_process_group("nccl")
            torch.cuda.set_device(local_rank)
            """,
            """
            import os
            import torch
            import torch.distributed as dist
            rank = int(os.environ["RANK"])
            dist.init_process_group("nccl")
            torch.cuda.set_device(rank % torch.cuda.device_count())
            """,
            """
            import torch
            import torch.multiprocessing as mp
            def main(rank):
                torch.cuda.set_device(rank)
            if __name__ == "__main__":
                mp.spawn(main, nprocs=2)
            """,
        ],
    ),
    (
        "lan-address",
        """
        import argparse
        import os
        import torch.distributed as dist
        parser = argparse.ArgumentParser()
        parser.add_argument("--dist-url", default="tcp://192.168.1.10:23456")  # expect: lan-address
        os.environ["MASTER_ADDR"] = "10.0.0.5"  # expect: lan-address
        addr = os.environ.get("MASTER_ADDR", "10.8.1.20")  # expect: lan-address
        port = int(os.getenv("MASTER_PORT", "29500"))
        dist.init_process_group("nccl", init_method=f"tcp://{addr}:{port}")
        host = os.getenv("MASTER_ADDR", "172.16.0.3")  # expect: lan-address
        """,
        [
            """
            import argparse
            import os
            parser = argparse.ArgumentParser()
            parser.add_argument("--dist-url", default="env://")
            parser.add_argument("--lr", default="0.1")
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ.setdefault("MASTER_ADDR", "localhost")
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            host = os.getenv("MASTER_ADDR", "localhost")
            peer = os.getenv("PEER", "10.0.0.9")
            """,
        ],
    ),
    (
        "grad-allreduce-after-ddp",
        """
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("nccl")
        model = DDP(net)
        loss = model(x).sum()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # expect: grad-allreduce-after-ddp
        """,
        [
            """
            import torch.distributed as dist
            dist.init_process_group("gloo")
            loss = net(x).sum()
            loss.backward()
            for p in net.parameters():
                dist.all_reduce(p.grad)
            """,
            """
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            dist.init_process_group("nccl")
            model = DDP(net)
            with model.no_sync():
                model(x).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            """,
        ],
    ),
]


# Shapes real scripts are written in (the corpus in doctor_scripts/real/): each must give
# exactly its `# expect:` findings, and none where there is no `# expect:`.
SHAPES: dict[str, str] = {
    "save through a helper, wrapped in branches and a call chain (imagenet)": """
        import torch
        def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
            torch.save(state, filename)
        def build(args):
            model = make_model()
            if args.distributed:
                model = torch.nn.parallel.DistributedDataParallel(model)
            elif args.gpu is not None:
                model = model.cuda(args.gpu)
            else:
                model = torch.nn.DataParallel(model).cuda()
            state = {"state_dict": model.state_dict(), "epoch": 1}
            save_checkpoint(state, True)  # expect: wrapped-state-dict
        """,
    "wrapped in __init__, saved in another method (DDP tutorial's Trainer)": """
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        class Trainer:
            def __init__(self, model, gpu_id):
                self.model = DDP(model.to(gpu_id), device_ids=[gpu_id])
                self.gpu_id = gpu_id
            def save(self):
                if self.gpu_id == 0:
                    torch.save(self.model.state_dict(), "ckpt.pt")  # expect: wrapped-state-dict
            def save_plain(self):
                if self.gpu_id == 0:
                    torch.save(self.model.module.state_dict(), "checkpoint.pt")
                    raw = self.model.module if hasattr(self.model, "module") else self.model
                    torch.save({"model": raw.state_dict()}, "snapshot.pt")
        """,
    "DataParallel of a submodule, then the whole model moved (imagenet's alexnet/vgg)": """
        import torch
        model = make_model()
        model.features = torch.nn.DataParallel(model.features)
        model.cuda()
        """,
    "evaluation sampler with drop_last=True, the tail evaluated apart (imagenet)": """
        import torch
        from torch.utils.data import DataLoader, DistributedSampler
        val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
        val_loader = DataLoader(val_dataset, sampler=val_sampler, num_workers=4, pin_memory=True)
        """,
    "print in the launcher, before horovod.run starts the workers (Horovod's mnist)": """
        import horovod
        import horovod.torch as hvd
        def main(args):
            hvd.init()
            print("training")  # expect: unguarded-output
        if __name__ == "__main__":
            if args.num_proc:
                print("Running training through horovod.run")
                horovod.run(main, args=(args,), np=args.num_proc)
            else:
                main(args)
        """,
    "Trainer methods print on every rank and sync every step (minGPT's trainer)": """
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        class Trainer:
            def __init__(self, model, local_rank):
                self.local_rank = local_rank
                self.model = DDP(model.to(local_rank), device_ids=[local_rank])
                self._load_snapshot()
            def _load_snapshot(self):
                print("Snapshot not found. Training model from scratch")  # expect: unguarded-output
            def _run_batch(self, source, targets):
                loss = self.model(source, targets)
                loss.backward()
                return loss.item()  # expect: sync-every-step
            def _run_epoch(self, loader):
                for source, targets in loader:
                    source = source.to(self.local_rank)
                    batch_loss = self._run_batch(source, targets)
            def train(self, loader):
                for epoch in range(10):
                    self._run_epoch(loader)
                    if self.local_rank == 0:
                        print("epoch done")
        def main():
            dist.init_process_group("nccl")
            trainer = Trainer(make_model(), int(os.environ["LOCAL_RANK"]))
            trainer.train(make_loader())
        if __name__ == "__main__":
            main()
        """,
    "a validation loss of one shard steps the scheduler": """
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler
        dist.init_process_group("gloo")
        sampler = DistributedSampler(val_set)  # expect: eval-distributed-sampler
        val_loader = DataLoader(val_set, sampler=sampler, batch_size=8)
        def validate(model, best):
            val_loss = 0.0
            for x, y in val_loader:
                val_loss += loss_fn(model(x), y).item()
            scheduler.step(val_loss)  # expect: metric-without-reduce
            return val_loss
        """,
    "the best model chosen on one shard's validation loss": """
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler
        dist.init_process_group("gloo")
        def validate(model, best):
            sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
            val_loader = DataLoader(val_set, sampler=sampler)
            val_loss = 0.0
            for x, y in val_loader:
                val_loss += loss_fn(model(x), y).item()
            if val_loss < best:  # expect: metric-without-reduce
                best = val_loss
            return best
        """,
    "gradients averaged by a helper after DDP averaged them": """
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        def average_gradients(model):
            size = float(dist.get_world_size())
            for param in model.parameters():
                dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
                param.grad.data /= size
        dist.init_process_group("gloo")
        ddp_model = DDP(model)
        ddp_model(x).sum().backward()
        average_gradients(ddp_model)  # expect: grad-allreduce-after-ddp
        average_gradients(other_model)
        """,
    "set_epoch given a value that never changes": """
        from torch.utils.data import DataLoader, DistributedSampler
        sampler = DistributedSampler(train_set)
        loader = DataLoader(train_set, sampler=sampler)
        start = 0
        for epoch in range(3):
            sampler.set_epoch(start)  # expect: set-epoch
            for x in loader:
                pass
        """,
    "set_epoch(0) once, then the loader iterated again and again by steps": """
        from torch.utils.data import DataLoader, DistributedSampler
        sampler = DistributedSampler(corpus, shuffle=True)
        loader = DataLoader(corpus, batch_size=8, sampler=sampler)
        data_iter = iter(loader)
        sampler.set_epoch(0)  # expect: set-epoch
        for step in range(train_iters):
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(loader)
                batch = next(data_iter)
        """,
    "set_epoch of the epoch, a parameter, or a counter: no finding": """
        from torch.utils.data import DistributedSampler
        sampler = DistributedSampler(train_set)
        def one_epoch(epoch):
            sampler.set_epoch(epoch)
        step = 0
        for _ in range(3):
            step += 1
            sampler.set_epoch(step)
        """,
    "an Accelerator built in a conditional expression still prepares padded loaders": """
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True) if args.cpu else Accelerator(mixed_precision="bf16")
        model, eval_loader = accelerator.prepare(model, eval_loader)  # expect: eval-padded-loader
        for batch in eval_loader:
            preds = accelerator.gather(model(batch))
        """,
    "paratrain evaluation loader: each sample once, but each process sums its share": """
        import paratrain
        def main(rt):
            loader = rt.setup_loader(test_loader, evaluation=True)
            correct = 0
            for x, y in loader:
                correct += (model(x).argmax(1) == y).sum()
            rt.print("accuracy", correct / 10_000)  # expect: metric-without-reduce
        if __name__ == "__main__":
            paratrain.Runtime(strategy="ddp", devices="cpu,cpu").launch(main)
        """,
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_real_script_shapes(shape: str) -> None:
    source = textwrap.dedent(SHAPES[shape])
    assert found(source) == expected(source)


def test_every_rule_has_a_case() -> None:
    assert sorted(rule for rule, _, _ in CASES) == sorted(rule.id for rule in RULES)


@pytest.mark.parametrize(("rule", "bad", "near_misses"), CASES, ids=[c[0] for c in CASES])
def test_rule_finds_its_mistake_and_not_its_near_miss(
    rule: str, bad: str, near_misses: list[str]
) -> None:
    source = textwrap.dedent(bad)
    want = expected(source)
    assert want and {r for _, r in want} == {rule}
    assert found(source) == want
    for clean in near_misses:
        assert found(clean) == [], clean


@pytest.mark.parametrize(
    ("name", "style", "findings"),
    [
        ("seed004_ddp.py", "ddp", [(37, "fixed-port"), (76, "loader-pin-memory")]),
        ("seed000_cuda.py", "plain", [(11, "create-then-move"), (12, "create-then-move")]),
        ("seed000_dataparallel.py", "dataparallel", [(9, "dataparallel-on-cpu")]),
        ("ddp_mistakes.py", "ddp", expected((SCRIPTS / "ddp_mistakes.py").read_text())),
        ("ddp_clean.py", "ddp", []),
    ],
)
def test_seed_style_scripts(name: str, style: str, findings: list[tuple[int, str]]) -> None:
    diagnosis = diagnose(SCRIPTS / name)
    assert diagnosis.style.name == style
    assert [(f.line, f.rule) for f in diagnosis.findings] == findings


def test_ddp_mistakes_covers_most_rules() -> None:
    rules = {rule for _, rule in expected((SCRIPTS / "ddp_mistakes.py").read_text())}
    assert len(rules) == 11


@pytest.mark.parametrize(
    ("source", "style"),
    [
        ("import torch\nmodel = torch.nn.Linear(2, 1)", "plain"),
        ("from torch import nn\nm = nn.DataParallel(net)", "dataparallel"),
        ("import torch.distributed as dist\ndist.init_process_group('nccl')", "ddp"),
        ("from accelerate import Accelerator", "accelerate"),
        ("from lightning.fabric import Fabric", "fabric"),
        ("import lightning_fabric as L", "fabric"),
        ("import horovod.torch as hvd", "horovod"),
        ("import torch.distributed as dist\nimport paratrain", "paratrain"),
    ],
)
def test_style_names_the_migration(source: str, style: str) -> None:
    assert diagnose_source(source).style.name == style


def test_cli_exit_codes_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", str(SCRIPTS / "ddp_clean.py")]) == 0
    out = capsys.readouterr().out
    assert "no findings" in out and 'docs/porting.md, "From DistributedDataParallel"' in out

    assert main(["doctor", str(SCRIPTS / "seed004_ddp.py")]) == 1
    out = capsys.readouterr().out
    assert f"{SCRIPTS / 'seed004_ddp.py'}:37: [fixed-port]" in out and "fix: " in out

    assert main(["doctor", "--json", str(SCRIPTS / "seed000_dataparallel.py")]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["findings"] == 1
    (script,) = report["scripts"]
    assert script["style"] == "dataparallel"
    assert script["migration"] == 'docs/porting.md, "From DataParallel"'
    assert script["findings"][0].keys() == {"file", "line", "rule", "message", "fix"}


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("broken.py", "def train(:\n", "broken.py:1: syntax error"),
        ("notes.txt", "print(1)\n", "is not a Python script"),
        ("missing.py", None, "cannot read"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: str | None, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert main(["doctor", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("paratrain: error:")


def test_an_fsdp_save_is_not_told_to_move_under_a_rank_guard() -> None:
    """FSDP's state_dict() is a collective: "do it on rank 0 only" would hang the others."""
    source = textwrap.dedent(
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        dist.init_process_group("nccl")
        model = FSDP(net)
        torch.save(model.state_dict(), "model.pt")
        """
    )
    (finding,) = diagnose_source(source).findings
    assert finding.rule == "unguarded-output"
    assert not finding.fix.startswith("do it on rank 0") and "must call it" in finding.fix


VALIDATE_HELPER = """
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
def validate(model, loader, criterion):
    total = 0.0
    with torch.no_grad():
        for x, y in loader:
            total += criterion(model(x), y).item()
    return total / len(loader)
def main(model, val_set, criterion, epochs):
    dist.init_process_group("gloo")
    sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_set, sampler=sampler)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    best = float("inf")
    for epoch in range(epochs):
        val_loss = validate(model, val_loader, criterion)
        scheduler.step(val_loss)  # expect: metric-without-reduce
"""


def test_a_partial_sum_returned_by_a_helper_is_found_in_its_caller() -> None:
    """``val_loss = validate(model, val_loader, ...)`` over a sharded loader, stepped into
    ReduceLROnPlateau or compared to pick the best model: each process uses its own share."""
    assert found(VALIDATE_HELPER) == expected(VALIDATE_HELPER)
    best = VALIDATE_HELPER.replace(
        "scheduler.step(val_loss)  # expect: metric-without-reduce",
        "if val_loss < best:  # expect: metric-without-reduce\n            best = val_loss",
    )
    assert found(best) == expected(best)
    pair = VALIDATE_HELPER.replace(
        "    return total / len(loader)", "    return total / len(loader), len(loader)"
    ).replace("val_loss = validate(", "val_loss, batches = validate(")
    assert found(pair) == expected(pair)
    same_name = (
        VALIDATE_HELPER.replace("(model, loader, criterion)", "(model, val_loader, criterion)")
        .replace("in loader:", "in val_loader:")
        .replace("len(loader)", "len(val_loader)")
    )
    assert found(same_name) == expected(same_name)


@pytest.mark.parametrize(
    ("old", "new"),
    [  # reduced in the helper or the caller; an unsharded loader; the result unused
        (
            "    return total",
            "    total = torch.tensor(total)\n    dist.all_reduce(total)\n    return total",
        ),
        (
            "        scheduler.step(val_loss)",
            "        dist.all_reduce(val_loss)\n        scheduler.step(val_loss)",
        ),
        ("val_loader = DataLoader(val_set, sampler=sampler)", "val_loader = DataLoader(val_set)"),
        ("        val_loss = validate(", "        validate("),
        (  # a helper doctor cannot read, whose name says it reduces
            "    return total",
            "    total = utils.get_all_reduce_mean(total).item()\n    return total",
        ),
    ],
)
def test_a_helper_whose_sum_is_reduced_or_unsharded_is_left_alone(old: str, new: str) -> None:
    clean = VALIDATE_HELPER.replace(old, new).replace("  # expect: metric-without-reduce", "")
    assert old in VALIDATE_HELPER and found(clean) == []


BRANCHED_AVERAGE = """
import torch
import torch.distributed as dist
def average_gradients(model):
    for param in model.parameters():
        dist.all_reduce(param.grad.data)
def train(args, net, loader, optimizer):
    distributed, use_cuda = len(args.hosts) > 1, args.num_gpus > 0
    dist.init_process_group("gloo")
    model = net.to("cuda" if use_cuda else "cpu")
    if distributed and use_cuda:
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        model = torch.nn.DataParallel(model)
    for x, y in loader:
        model(x).sum().backward()
        if distributed and not use_cuda:
            average_gradients(model)
        optimizer.step()
"""


def averaged_twice(source: str) -> list[int]:
    return [line for line, rule in found(source) if rule == "grad-allreduce-after-ddp"]


def test_gradients_averaged_by_hand_only_where_ddp_was_not_built_are_left_alone() -> None:
    """The CPU branch averages by hand; DDP is built in the CUDA branch only: the tests
    contradict each other, so the two never meet. Where they can meet, it is found."""
    assert averaged_twice(BRANCHED_AVERAGE) == []
    elsewhere = BRANCHED_AVERAGE.replace("if distributed and not use_cuda:", "if distributed:")
    assert averaged_twice(elsewhere) == [18]
    in_else = BRANCHED_AVERAGE.replace(
        "        if distributed and not use_cuda:\n            average_gradients(model)\n",
        "        if use_cuda:\n            pass\n"
        "        else:\n            average_gradients(model)\n",
    )
    assert averaged_twice(in_else) == []


SAVE_STATE_HOOK = """
from accelerate import Accelerator
def main(args, unet):
    accelerator = Accelerator()
    def save_model_hook(models, weights, output_dir):
        for model in models:
            model.save_pretrained(output_dir)
            weights.pop()
    accelerator.register_save_state_pre_hook(save_model_hook)
    unet = accelerator.prepare(unet)
    if accelerator.is_main_process:
        accelerator.save_state(args.output_dir)
    unet.save_pretrained(args.output_dir)  # expect: unguarded-output
if __name__ == "__main__":
    main(None, None)
"""


def test_a_save_state_hook_runs_where_save_state_runs() -> None:
    """A function handed to Accelerate's register_save_state_pre_hook is called by
    save_state (here on the main process), not where it is registered."""
    said = [(line, rule) for line, rule in found(SAVE_STATE_HOOK) if rule == "unguarded-output"]
    assert said == expected(SAVE_STATE_HOOK)
