"""Activation checkpointing per block (``Runtime(activation_checkpointing=True)``,
``--activation-checkpointing``): each block (the same blocks fsdp shards and pipeline cuts,
:mod:`paratrain.strategies.blocks`) keeps only its input in the forward and runs again in
the backward to get its activations back. Memory for time: the activations of all blocks
but one are not held at the peak, and each block's forward runs twice.

Each block's ``forward`` is replaced on the instance, so parameter names, checkpoints and
fsdp's hooks (which run around ``forward``) are unchanged. BatchNorm inside a block would
update its running statistics a second time when the forward runs again: during that rerun
their momentum is 0 and the batch count is put back, so the statistics are those of one
forward. The weights are the same as without (the same operations, in the same order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.strategies.blocks import choose_blocks

_MARK = "_paratrain_checkpointed"


def apply_activation_checkpointing(model: nn.Module, names: tuple[str, ...] = ()) -> int:
    """Checkpoint ``model``'s outermost blocks; returns how many (0: a model with none,
    which runs as it is)."""
    blocks = choose_blocks(model, names)
    inside = {id(m) for b in blocks for m in b.modules() if m is not b}
    outermost = [b for b in blocks if id(b) not in inside]
    for block in outermost:
        if not getattr(block, _MARK, False):
            block.forward = _checkpointed(block)
            setattr(block, _MARK, True)
    return len(outermost)


def _checkpointed(block: nn.Module) -> Callable[..., Any]:
    original = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to keep, nothing to rerun
            return original(*args, **kwargs)
        runs = [0]

        def run(*inner: Any, **inner_kwargs: Any) -> Any:
            runs[0] += 1
            rerun = _statistics_frozen(block) if runs[0] > 1 else contextlib.nullcontext()
            with rerun:
                return original(*inner, **inner_kwargs)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return forward


@contextlib.contextmanager
def _statistics_frozen(block: nn.Module) -> Iterator[None]:
    norms = [
        m
        for m in block.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
            if m.num_batches_tracked is not None:
                m.num_batches_tracked.sub_(1)
