"""Collectives over ``torch.distributed``, and the environment contract of its launchers.

A process is *launched* when ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
are set: torchrun, ``paratrain run`` and the processes ``rt.launch`` spawns all set them,
and ``init_process_group(init_method="env://")`` reads them.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paratrain.distributed import loopback
from paratrain.distributed.collective import Collective, ReduceOp, Reduction
from paratrain.distributed.collective_order import LEDGER
from paratrain.utils import environment
from paratrain.utils.errors import UserError

INIT_TIMEOUT_VARIABLE = "PARATRAIN_INIT_TIMEOUT"
COLLECTIVE_TIMEOUT_VARIABLE = "PARATRAIN_COLLECTIVE_TIMEOUT"
DEFAULT_INIT_TIMEOUT = 120.0
DEFAULT_COLLECTIVE_TIMEOUT = 1800.0

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def launched() -> bool:
    """Whether a launcher started this process as one rank of a group."""
    return environment.current().launched


def local_process_count() -> int | None:
    """How many processes the launcher started on this machine, None if not launched."""
    env = environment.current()
    return env.local_world_size if env.launched else None


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's agent, its store with a prefix per attempt; None elsewhere.

    The agent keeps one store across restarts, and gloo finds its peers' addresses under
    fixed keys in it: a restarted process would read the dead processes' addresses and
    time out connecting (torch 2.13). Each attempt gets keys of its own.
    """
    env = environment.current()
    if not env.agent_store or env.master_addr is None or env.master_port is None:
        return None
    loopback.pin_interfaces(env.master_addr)
    store = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"paratrain/attempt-{env.attempt}", store)


def loopback_store(timeout: timedelta) -> dist.Store | None:
    """Outside torchrun's agent, with the rendezvous on a loopback address (``rt.launch``'s
    spawned processes): the store, its server on rank 0 listening on loopback only (torch's
    ``env://`` would listen on every interface); None for any other address. Also pins
    gloo's and NCCL's sockets to the loopback interface."""
    env = environment.current()
    host, port = env.master_addr, env.master_port
    if host is None or port is None or not loopback.is_loopback(host):
        return None
    loopback.pin_interfaces(host)
    if env.rank == 0:
        return loopback.store_server(host, port, timeout, multi_tenant=True)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def timeout_from_env(name: str, default: float) -> timedelta:
    raw = environment.current().get(name)
    if not raw:
        return timedelta(seconds=default)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UserError(f"{name}={raw!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


class TorchCollective(Collective):
    """Collectives of one rank of a process group (gloo on CPU, nccl on CUDA).

    Every operation leaves its input unchanged and returns a new tensor on the input's
    device, like the one-process :class:`Collective` whose results are its inputs.
    """

    def __init__(
        self,
        rank: int,
        local_rank: int,
        world_size: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        # nccl only moves CUDA tensors; gloo moves CPU tensors.
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.group = group

    def _out(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(self.device, copy=True).contiguous()

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        if op not in _OPS:
            raise UserError(f"unknown reduce op {op!r}; use one of: {', '.join(_OPS)}")
        work = self._out(tensor)
        dist.all_reduce(work, _OPS[op], group=self.group)
        if op == "mean":
            work = work / self.world_size
        return work.to(tensor.device)

    def start_all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> Reduction:
        if op not in _OPS or op == "mean":
            raise UserError(f"start_all_reduce takes sum, max or min, not {op!r}")
        work = self._out(tensor)
        return _Started(work, dist.all_reduce(work, _OPS[op], group=self.group, async_op=True))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor``, in rank order. The first dimension may differ between
        ranks (an evaluation loader's last batch splits unevenly, as Accelerate's
        ``gather_for_metrics`` allows): the lengths are gathered first, each part padded to
        the longest and cut back after; every other dimension must agree."""
        work = self._out(tensor)
        if work.dim() == 0:
            parts = [torch.empty_like(work) for _ in range(self.world_size)]
            dist.all_gather(parts, work, group=self.group)
            return [part.to(tensor.device) for part in parts]
        length = torch.tensor([work.shape[0]], device=self.device)
        lengths = [torch.empty_like(length) for _ in range(self.world_size)]
        dist.all_gather(lengths, length, group=self.group)
        sizes = [int(size) for size in torch.cat(lengths).tolist()]
        longest = max(sizes)
        if work.shape[0] < longest:
            padding = work.new_zeros((longest - work.shape[0], *work.shape[1:]))
            work = torch.cat([work, padding])
        parts = [torch.empty_like(work) for _ in range(self.world_size)]
        dist.all_gather(parts, work, group=self.group)
        return [part[:size].to(tensor.device) for part, size in zip(parts, sizes, strict=True)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        device = self.device if self.device.type == "cuda" else None
        dist.broadcast_object_list(box, src=src, group=self.group, device=device)
        return box[0]

    def operation(self, name: str) -> contextlib.AbstractContextManager[None]:
        return LEDGER.operation(name)

    def barrier(self) -> None:
        if self.device.type == "cuda":
            dist.barrier(group=self.group, device_ids=[self.device.index or 0])
        else:
            dist.barrier(group=self.group)


class _Started(Reduction):
    """gloo: the all-reduce runs on gloo's threads while this process goes on; nccl: on
    the collective's stream (waiting makes the current stream wait, not the host)."""

    def __init__(self, tensor: torch.Tensor, work: Any) -> None:
        super().__init__(tensor)
        self._work: Any = work

    def result(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor
