"""`paratrain doctor` on shapes of public scripts it used to misjudge (each cut down from a
script of the corpus): a finding where there is a mistake, silence or
"unsure" where what decides is out of its sight."""

from __future__ import annotations

import textwrap

from paratrain.tools.doctor import diagnose_source


def _said(source: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(sure findings, unsure findings) as (line, rule)."""
    diagnosis = diagnose_source(textwrap.dedent(source))
    return (
        [(f.line, f.rule) for f in diagnosis.findings],
        [(f.line, f.rule) for f in diagnosis.unsure],
    )


def test_gradients_averaged_again_after_a_wrapper_that_averages_them_in_hooks() -> None:
    """Kubeflow's DDP example: its own DistributedDataParallel all-reduces every gradient
    from a hook, and the loop calls average_gradients(model) as well."""
    source = """
        import torch.distributed as dist
        from torch.nn.modules import Module
        from torch.autograd import Variable

        class DistributedDataParallel(Module):
            def __init__(self, module):
                super().__init__()
                self.module = module
                def allreduce_params():
                    grads = [p.grad.data for p in self.module.parameters()]
                    for g in grads:
                        dist.all_reduce(g)
                        g /= dist.get_world_size()
                for param in self.module.parameters():
                    def hook(*unused):
                        Variable._execution_engine.queue_callback(allreduce_params)
                    param.register_hook(hook)

        def average_gradients(model):
            for param in model.parameters():
                dist.all_reduce(param.grad.data)

        def run():
            model = DistributedDataParallel(Net())
            model(x).sum().backward()
            average_gradients(model)
    """
    sure, _ = _said(source)
    assert sure == [(27, "grad-allreduce-after-ddp")]
    # a wrapper class that never all-reduces in a hook is not DDP
    plain = source.replace("param.register_hook(hook)", "pass")
    assert _said(plain) == ([], [])


def test_a_stdout_that_labels_each_line_with_the_rank_is_rank_aware() -> None:
    source = """
        import sys
        import torch.distributed as dist

        class LabeledStdout:
            def __init__(self, rank, size):
                self._r, self._s = rank, size
            def write(self, x):
                sys.__stdout__.write(f"[{self._r}/{self._s}] {x}")

        dist.init_process_group("gloo")
        sys.stdout = LabeledStdout(dist.get_rank(), dist.get_world_size())
        print("epoch done")
    """
    assert _said(source) == ([], [])
    # a stdout replaced by a plain log file is not rank-aware
    teed = source.replace(
        "LabeledStdout(dist.get_rank(), dist.get_world_size())", "open('log.txt', 'w')"
    )
    assert _said(teed)[0] == [(13, "unguarded-output")]


def test_a_rank_kept_in_an_options_mapping_guards_the_output() -> None:
    """KAIR: ``if opt['rank'] == 0: logger.info(...)``."""
    source = """
        import logging
        import torch.distributed as dist
        dist.init_process_group("nccl")
        opt = {"rank": dist.get_rank()}
        logger = logging.getLogger("train")
        if opt["rank"] == 0:
            logger.info("options")
        logger.info("every rank")
    """
    assert _said(source) == ([(9, "unguarded-output")], [])


def test_a_sampler_handed_to_a_trainer_doctor_cannot_read_is_unsure() -> None:
    """NanoDet: the loader goes to ``trainer.run(...)`` of a package doctor did not find,
    whose run_epoch calls set_epoch."""
    source = """
        import torch
        import torch.distributed as dist
        from nanodet.trainer import build_trainer
        dist.init_process_group("nccl")
        sampler = torch.utils.data.distributed.DistributedSampler(train_set)
        loader = torch.utils.data.DataLoader(
            train_set, sampler=sampler, num_workers=4, pin_memory=True
        )
        trainer = build_trainer(0, cfg, model)
        trainer.run(loader)
    """
    assert _said(source) == ([], [(6, "set-epoch")])


def test_a_shuffle_read_from_a_config_is_unsure() -> None:
    """KAIR: ``DistributedSampler(train_set, shuffle=dataset_opt['dataloader_shuffle'])``
    and no set_epoch anywhere."""
    source = """
        from torch.utils.data import DataLoader, DistributedSampler
        sampler = DistributedSampler(train_set, shuffle=opt["shuffle"], drop_last=True)
        loader = DataLoader(train_set, sampler=sampler)
        for epoch in range(10):
            for batch in loader:
                pass
    """
    assert _said(source) == ([], [(3, "set-epoch")])
    assert _said(source.replace('opt["shuffle"]', "False")) == ([], [])


def test_a_resume_checkpoint_beside_an_unwrapped_export_is_left_alone() -> None:
    """Barlow Twins, VICReg: the wrapped state_dict goes to a checkpoint the script loads
    back into the same DDP model; what others load is saved from ``model.module``."""
    source = """
        import torch
        import torch.distributed as dist
        dist.init_process_group("nccl")
        model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[0])
        for epoch in range(10):
            if dist.get_rank() == 0:
                state = dict(epoch=epoch + 1, model=model.state_dict())
                torch.save(state, "checkpoint.pth")
        if dist.get_rank() == 0:
            torch.save(model.module.backbone.state_dict(), "resnet50.pth")
    """
    assert _said(source) == ([], [])
    only_wrapped = source.replace('model.module.backbone.state_dict(), "resnet50.pth"', "0, 'x'")
    assert _said(only_wrapped) == ([(9, "wrapped-state-dict")], [])


def test_torch_save_is_not_the_files_own_save_method_with_a_barrier() -> None:
    """improved-diffusion: ``def save(self)`` ends with ``dist.barrier()``, and writes with
    ``th.save`` under ``if dist.get_rank() == 0``: torch's save is no collective."""
    source = """
        import torch as th
        import torch.distributed as dist

        class TrainLoop:
            def save(self):
                if dist.get_rank() == 0:
                    th.save(self.model.state_dict(), "model.pt")
                dist.barrier()

            def run(self):
                if dist.get_rank() == 0:
                    self.save()

        dist.init_process_group("nccl")
        TrainLoop().run()
    """
    assert _said(source) == ([(13, "collective-under-guard")], [])


def test_set_epoch_of_a_value_the_epoch_loop_never_changes() -> None:
    """A student project's BERT fine-tuning (jbnu_nsmc of the corpus): the loop runs over
    ``epoch_id`` and hands the sampler ``config.epochs``, the same every epoch."""
    source = """
        from torch.utils.data import DataLoader, DistributedSampler

        def main_(gpu, config, train_dataset):
            train_sampler = DistributedSampler(train_dataset, rank=gpu, shuffle=True)
            loader = DataLoader(train_dataset, batch_size=32, sampler=train_sampler)
            for epoch_id in range(config.epochs):
                train_sampler.set_epoch(config.epochs)
                for batch in loader:
                    step(batch)

        def train(loader, num_epochs):
            for i in range(num_epochs):
                loader.sampler.set_epoch(num_epochs)
                for batch in loader:
                    step(batch)
    """
    sure, _ = _said(source)
    assert sure == [(8, "set-epoch"), (14, "set-epoch")]
    # the epoch itself, a counter the loop advances, or one sampler per pass: silent
    for fixed, varying in [
        ("set_epoch(config.epochs)", "set_epoch(epoch_id)"),
        ("set_epoch(num_epochs)", "set_epoch(i)"),
    ]:
        source = source.replace(fixed, varying)
    assert _said(source) == ([], [])
    counter = """
        def train(loader, args):
            while args.epoch < args.max_epoch:
                loader.sampler.set_epoch(args.epoch)
                args.epoch += 1
        def run(loaders, epoch):
            for loader in loaders:
                loader.sampler.set_epoch(epoch)
    """
    assert _said(counter) == ([], [])


def test_set_epoch_0_at_construction_then_the_epoch_each_epoch_is_left_alone() -> None:
    """HKBU-HPML/MG-WFBP's trainer calls set_epoch(0) where it builds the sampler and
    set_epoch(self.train_epoch) at each new epoch; Grover's test sampler does not shuffle."""
    source = """
        import torch
        from torch.utils.data.distributed import DistributedSampler

        class Trainer:
            def data_prepare(self, trainset):
                train_sampler = torch.utils.data.distributed.DistributedSampler(trainset)
                train_sampler.set_epoch(0)
                self.train_sampler = train_sampler

            def train(self, num_of_iters):
                for i in range(num_of_iters):
                    if self.train_iter % self.num_batches_per_epoch == 0:
                        self.train_epoch += 1
                        self.train_sampler.set_epoch(self.train_epoch)

        def pretrain(test_data):
            test_sampler = DistributedSampler(test_data, shuffle=False)
            test_sampler.set_epoch(1)
    """

    def set_epoch(text: str) -> list[tuple[int, str]]:
        sure, unsure = _said(text)
        return [found for found in sure + unsure if found[1] == "set-epoch"]

    assert set_epoch(source) == []
    # alone, set_epoch(0) before a loader is iterated step after step is a mistake
    alone = source.replace("self.train_sampler.set_epoch(self.train_epoch)", "pass")
    assert set_epoch(alone) == [(8, "set-epoch")]
