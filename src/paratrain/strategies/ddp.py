"""DistributedDataParallel: one process per device, gradients all-reduced (seed 004).

nccl on CUDA, gloo on the CPU. ``--devices N`` means cuda:0..N-1 where CUDA exists and N
CPU processes where it does not; ``0,1``, ``cuda:0,cuda:1`` and ``cpu,cpu`` name them. In a
process started by torchrun the devices default to one per local process.

Timeouts (seconds, environment): ``PARATRAIN_INIT_TIMEOUT`` (default 120) bounds the wait
for every process to join the group, so a rank that dies or hangs before joining fails the
run instead of hanging it; ``PARATRAIN_COLLECTIVE_TIMEOUT`` (default 1800) bounds each
collective once the group exists.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.devices.machine import check_cuda_devices, cuda_count, parse_count, parse_device_list
from paratrain.distributed import collective_order
from paratrain.strategies.base import Strategy, StrategyOptions
from paratrain.strategies.distributed import (
    COLLECTIVE_TIMEOUT_VARIABLE,
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_INIT_TIMEOUT,
    INIT_TIMEOUT_VARIABLE,
    TorchCollective,
    attempt_store,
    launched,
    local_process_count,
    loopback_store,
    timeout_from_env,
)
from paratrain.strategies.registry import register
from paratrain.strategies.sync_batchnorm import make_cpu_compatible
from paratrain.utils import environment
from paratrain.utils.catalog import STRATEGIES
from paratrain.utils.errors import LaunchError, UserError


@register
class DDPStrategy(Strategy):
    name = "ddp"
    syncs_batchnorm = True
    spans_machines = True
    description = STRATEGIES["ddp"]

    def __init__(
        self,
        devices: list[torch.device],
        options: StrategyOptions | None = None,
        init_timeout: timedelta | None = None,
        collective_timeout: timedelta | None = None,
    ) -> None:
        super().__init__(devices, options)
        self.init_timeout = init_timeout or timeout_from_env(
            INIT_TIMEOUT_VARIABLE, DEFAULT_INIT_TIMEOUT
        )
        self.collective_timeout = collective_timeout or timeout_from_env(
            COLLECTIVE_TIMEOUT_VARIABLE, DEFAULT_COLLECTIVE_TIMEOUT
        )
        # Known from the launcher's environment before the group exists, so rt.rank works
        # (and the right device is chosen) before joining.
        env = environment.current()
        self.local_rank = env.local_rank if env.launched else 0
        if self.local_rank >= len(devices):
            raise UserError(
                f"LOCAL_RANK {self.local_rank} has no device: --devices names {len(devices)}"
            )
        rank = env.rank if env.launched else 0
        world_size = env.world_size if env.launched else len(devices)
        self.collective = TorchCollective(rank, self.local_rank, world_size, self.root_device)
        self._owns_group = False
        self._wrapped: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()

    @classmethod
    def resolve_devices(cls, spec: str | None) -> list[torch.device]:
        local = local_process_count()
        count = parse_count(spec)  # UserError for 0 or a negative count
        if spec is None:
            count = local if local is not None else max(cuda_count(), 1)
        if count is not None:
            if cuda_count() > 0:
                devices = [torch.device("cuda", index) for index in range(count)]
            else:
                devices = [torch.device("cpu")] * count
        else:
            devices = parse_device_list(str(spec))
        kinds = {device.type for device in devices}
        if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
            raise UserError(
                f"--strategy {cls.name} needs CUDA devices or CPU processes of one kind, got "
                f"--devices {spec}; write e.g. 0,1 or cpu,cpu"
            )
        check_cuda_devices(devices)
        if "cuda" in kinds and len(set(devices)) != len(devices):
            raise UserError(
                f"--devices {spec} names a GPU twice; {cls.name} runs one process per GPU"
            )
        if local is not None and len(devices) != local:
            raise UserError(
                f"the launcher started {local} process(es) on this machine but --devices {spec} "
                f"names {len(devices)}; omit --devices or make them agree"
            )
        return devices

    @classmethod
    def count_processes(cls, devices: list[torch.device]) -> int:
        return len(devices)

    @property
    def root_device(self) -> torch.device:
        return self.devices[self.local_rank]

    @property
    def backend(self) -> str:
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    def setup_process(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        if not dist.is_initialized():
            self._join()
        self.collective = TorchCollective(
            dist.get_rank(), self.local_rank, dist.get_world_size(), self.root_device
        )
        if self.options.collective_check:
            collective_order.start(self.collective.rank, self.collective.world_size)

    def _join(self) -> None:
        if launched():
            try:
                store = attempt_store(self.init_timeout) or loopback_store(self.init_timeout)
                if store is None:
                    dist.init_process_group(
                        self.backend, init_method="env://", timeout=self.init_timeout
                    )
                else:
                    dist.init_process_group(
                        self.backend,
                        store=store,
                        rank=environment.current().rank,
                        world_size=environment.current().world_size,
                        timeout=self.init_timeout,
                    )
            except (RuntimeError, ValueError, OSError) as exc:  # OSError: the port taken
                rank, world = self.collective.rank, self.collective.world_size
                seconds = self.init_timeout.total_seconds()
                raise LaunchError(
                    f"rank {rank}: the {world} processes did not all join the process group "
                    f"within {seconds:g}s ({INIT_TIMEOUT_VARIABLE}); another process failed "
                    f"or hung before joining. Cause: {str(exc).splitlines()[0]}"
                ) from exc
        elif len(self.devices) == 1:
            # A one-process group needs no rendezvous and no port.
            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            raise UserError(
                f"strategy {self.name} runs {len(self.devices)} processes: put the training in a "
                "function and call rt.launch(fn), or start the script with torchrun or "
                "`paratrain run`"
            )
        self._owns_group = True
        atexit.register(self._teardown_at_exit)
        # The short timeout was for joining; collectives may legitimately wait longer
        # (the main process saving a checkpoint while the others wait at a barrier).
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is not None:
            set_timeout(self.collective_timeout)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if self.root_device.type == "cpu":
            make_cpu_compatible(model)
        device_ids = [self.root_device] if self.root_device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
        self._wrapped.add(wrapped)
        return wrapped

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        model = getattr(model, "_orig_mod", model)  # torch.compile(DDP(model))
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def forward_state(self, model: nn.Module) -> Any:
        ddp = getattr(model, "_orig_mod", model)
        if isinstance(ddp, DistributedDataParallel):
            return ddp.require_forward_param_sync
        return None

    def forget_forward(self, model: nn.Module, state: Any) -> None:
        # A forward that ended (on some processes) prepared DDP's reducer for a backward:
        # left so, the next backward would all-reduce there even under no_sync, and not on a
        # process whose forward failed. Every process resets it (the buckets are rebuilt on
        # all alike) and takes back the buffer-sync flag its forward set.
        ddp = getattr(model, "_orig_mod", model)
        if isinstance(ddp, DistributedDataParallel):
            ddp.reducer._reset_state()
            ddp.require_forward_param_sync = bool(state)

    def _teardown_at_exit(self) -> None:
        # After an uncaught exception, leave the group by dying: peers then fail after this
        # process is gone, so torchrun reports this rank as the cause, not a peer.
        if getattr(sys, "last_value", None) is not None:
            return
        self.teardown()
        # A DDP model left in a module global outlives this handler and keeps the group's
        # gloo threads alive; if they free their last work (which holds Python objects)
        # while the interpreter finalizes, the process aborts. Free them now instead.
        for model in list(self._wrapped):
            for name in ("reducer", "logger", "process_group"):
                vars(model).pop(name, None)

    def teardown(self) -> None:
        """Leave the group together: every process calls this at the end of a healthy run.

        The barrier matters: without it a process may destroy its group while a peer still
        uses it. On gloo it is ``monitored_barrier``, whose work this thread frees: a work
        freed by gloo's own threads while the interpreter exits aborts the process (SIGABRT).
        After a failure, a process leaves by exiting instead.
        """
        if self._owns_group and dist.is_initialized():
            with (
                contextlib.suppress(RuntimeError),  # a peer already gone: leave anyway
                self.collective.operation(collective_order.END_OF_RUN),
            ):
                if self.backend == "gloo":
                    dist.monitored_barrier(timeout=self.collective_timeout)
                else:
                    self.collective.barrier()
            collective_order.stop()
            dist.destroy_process_group()
        self._owns_group = False

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "backend": self.backend}
