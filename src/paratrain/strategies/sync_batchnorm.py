"""SyncBatchNorm on the CPU (gloo).

PyTorch's ``nn.SyncBatchNorm`` raises on CPU inputs (its kernels exist for GPUs only) and
DistributedDataParallel refuses it on CPU modules. On CPU processes the strategy therefore
turns each one into :class:`CPUSyncBatchNorm`, which computes the same thing from two
all-reduces (sum and count, then the sum of squared deviations) with gradients flowing back
through them, so ``--sync-batchnorm`` gives the one-process result on gloo too. On GPUs it
stays PyTorch's own implementation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm


class _SumAcrossRanks(torch.autograd.Function):
    """all_reduce(SUM) whose backward is all_reduce(SUM) of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        result = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(result, group=group)
        return result

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        result = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(result, group=ctx.group)
        return result, None


def _sum_across_ranks(tensor: Tensor, group: Any) -> Tensor:
    return _SumAcrossRanks.apply(tensor, group)


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the batch over all processes.

    Made from an ``nn.SyncBatchNorm`` by :func:`make_cpu_compatible` (same parameters,
    buffers and ``process_group``); not a subclass of it, which DDP refuses on CPU.
    """

    process_group: Any

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        group = self.process_group or dist.group.WORLD
        if not self.training or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return super().forward(input)
        self._check_input_dim(input)
        if input.numel() == 0:
            raise ValueError("SyncBatchNorm needs at least one sample on every process")
        dims = [0, *range(2, input.dim())]
        shape = [1, input.shape[1]] + [1] * (input.dim() - 2)

        count = torch.tensor([input.numel() / input.shape[1]], dtype=input.dtype)
        totals = _sum_across_ranks(torch.cat([input.sum(dims), count]), group)
        n = totals[-1].detach()
        mean = totals[:-1] / n
        centered = input - mean.view(shape)
        var = _sum_across_ranks(centered.pow(2).sum(dims), group) / n
        output = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None and self.bias is not None:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(n))
        return output

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, var: Tensor, n: float) -> None:
        if self.running_mean is None or self.running_var is None:
            return
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average, as nn.BatchNorm does
            assert self.num_batches_tracked is not None
            factor = 1.0 / float(self.num_batches_tracked.item())
        else:
            factor = self.momentum
        unbiased = var * n / max(n - 1.0, 1.0)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)


def make_cpu_compatible(model: nn.Module) -> nn.Module:
    """Turn every ``nn.SyncBatchNorm`` in ``model`` into a :class:`CPUSyncBatchNorm` (in
    place). Only the class changes: parameters, buffers and state-dict keys stay the same."""
    for module in model.modules():
        if type(module) is nn.SyncBatchNorm:
            module.__class__ = CPUSyncBatchNorm  # type: ignore[assignment]
    return model
