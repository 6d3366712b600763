"""Scatter, replicate, apply in threads, gather: the pieces of one-process data parallelism.

Unlike ``torch.nn.parallel`` these work on any device list, CPU and repeated devices
included (``cpu,cpu``, ``cuda:0,cuda:0``), split batches like the loaders do (first parts one
sample larger, never an empty part), and carry the caller's autocast dtype into the worker
threads: autocast is thread-local, and ``torch.nn.parallel.parallel_apply`` re-enters it
for CUDA with the default dtype only (fp16, even under bf16).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.strategies.base import iter_tensors
from paratrain.utils.errors import UserError

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(total), parts)``: the first parts one larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


def batch_size_of(obj: Any) -> int | None:
    """Rows of the first tensor with a batch dimension in nested tuples, lists and dicts."""
    for tensor in iter_tensors(obj):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


def scatter(obj: Any, sizes: Sequence[int], devices: Sequence[torch.device]) -> list[Any]:
    """Split every tensor in ``obj`` along dim 0 into ``sizes``; part ``i`` goes to
    ``devices[i]``. Tensors without a batch dimension and other objects go to every part."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return [obj.to(device) for device in devices]
        if obj.shape[0] != sum(sizes):
            raise UserError(
                f"data-parallel strategies split every input tensor along dimension 0, but got "
                f"a tensor with {obj.shape[0]} rows in a batch of {sum(sizes)}; pass per-sample "
                "tensors only (keep shared tensors in the model or the loss module)"
            )
        parts = torch.split(obj, list(sizes))
        return [_to(part, device) for part, device in zip(parts, devices, strict=True)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        columns = [scatter(item, sizes, devices) for item in obj]
        return [type(obj)(*(column[i] for column in columns)) for i in range(len(sizes))]
    if isinstance(obj, (list, tuple)):
        columns = [scatter(item, sizes, devices) for item in obj]
        return [type(obj)(column[i] for column in columns) for i in range(len(sizes))]
    if isinstance(obj, dict):
        scattered = {key: scatter(value, sizes, devices) for key, value in obj.items()}
        return [type(obj)((k, v[i]) for k, v in scattered.items()) for i in range(len(sizes))]
    return [obj for _ in sizes]


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Device-to-device copies are ordered on the streams; non_blocking only skips a host wait.
    return tensor.to(device, non_blocking=device.type == "cuda")


def gather(parts: Sequence[Any], device: torch.device) -> Any:
    """Inverse of :func:`scatter`: concatenate matching tensors along dim 0 on ``device``.

    Scalars (0-dim tensors) are stacked, one entry per part, as ``nn.DataParallel`` does.
    """
    first = parts[0]
    if isinstance(first, torch.Tensor):
        moved = [part.to(device) for part in parts]
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(gather(column, device) for column in zip(*parts, strict=True)))
    if isinstance(first, (list, tuple)):
        return type(first)(gather(column, device) for column in zip(*parts, strict=True))
    if isinstance(first, dict):
        return type(first)((key, gather([p[key] for p in parts], device)) for key in first)
    return first


def shallow_replica(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s tree that shares its parameters and clones its buffers.

    A replica on the same device as the original needs no parameter copy: gradients of both
    accumulate into the same tensors. Its buffers are private, so a BatchNorm replica
    updating running statistics cannot race the original; as in ``nn.DataParallel`` only the
    first replica's updates are kept.
    """
    copies: dict[nn.Module, nn.Module] = {}

    def copy(original: nn.Module) -> nn.Module:
        if original in copies:  # a submodule used twice stays one module
            return copies[original]
        replica = original._replicate_for_data_parallel()
        replica._parameters = original._parameters
        replica._buffers = {
            name: None if buffer is None else buffer.clone()
            for name, buffer in original._buffers.items()
        }
        copies[original] = replica
        replica._modules = {
            name: None if child is None else copy(child)
            for name, child in original._modules.items()
        }
        return replica

    return copy(module)


def replicas_for(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One module per entry of ``devices`` (on that device), built for this forward pass.

    The first entry is ``module`` itself when every device is the same one; distinct CUDA
    devices get ``torch.nn.parallel.replicate`` copies whose gradients flow back to
    ``module``; a device listed again gets a :func:`shallow_replica` of its first replica.
    """
    distinct = list(dict.fromkeys(devices))
    if len(distinct) == 1:
        base = {distinct[0]: module}
    else:
        detach = not torch.is_grad_enabled()
        copies = nn.parallel.replicate(module, distinct, detach=detach)
        base = dict(zip(distinct, copies, strict=True))
    result: list[nn.Module] = []
    seen: set[torch.device] = set()
    for device in devices:
        result.append(shallow_replica(base[device]) if device in seen else base[device])
        seen.add(device)
    return result


@dataclass(frozen=True)
class ThreadState:
    """The calling thread's thread-local torch modes, to re-enter in a worker thread."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype], ...]
    autocast_cache: bool

    @classmethod
    def capture(cls) -> ThreadState:
        autocast = tuple(
            (device_type, torch.get_autocast_dtype(device_type))
            for device_type in AUTOCAST_DEVICE_TYPES
            if torch.is_autocast_enabled(device_type)
        )
        return cls(
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            autocast,
            torch.is_autocast_cache_enabled(),
        )

    @property
    def autocast_enabled(self) -> bool:
        return bool(self.autocast)

    def enter(self, stack: contextlib.ExitStack) -> None:
        if self.inference_mode:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for device_type, dtype in self.autocast:
            stack.enter_context(
                torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache)
            )


class WorkerError(RuntimeError):
    """An exception of a worker whose type could not be rebuilt with a message."""


def _name_device(exc: Exception, where: str) -> Exception:
    """The same kind of exception, its message naming where it happened."""
    message = f"{exc} ({where})"
    try:
        return type(exc)(message)
    except Exception:  # a constructor that takes more than a message
        return WorkerError(f"{type(exc).__name__}: {message}")


def parallel_apply(
    fns: Sequence[Callable[..., Any]],
    args: Sequence[Sequence[Any]],
    kwargs: Sequence[dict[str, Any]],
    devices: Sequence[torch.device],
) -> list[Any]:
    """``fns[i](*args[i], **kwargs[i])`` on ``devices[i]``, one thread each, concurrently.

    Each thread re-enters the caller's grad mode, inference mode and autocast (with its
    dtype), and on CUDA the caller's current stream of its device. The first failing part
    raises in the caller, its message naming the device.
    """
    state = ThreadState.capture()
    streams = {d: torch.cuda.current_stream(d) for d in set(devices) if d.type == "cuda"}
    results: list[Any] = [None] * len(fns)
    errors: list[Exception | None] = [None] * len(fns)

    def work(index: int) -> None:
        device = devices[index]
        try:
            with contextlib.ExitStack() as stack:
                if device.type == "cuda":
                    stack.enter_context(torch.cuda.device(device))
                    stack.enter_context(torch.cuda.stream(streams[device]))
                state.enter(stack)
                results[index] = fns[index](*args[index], **kwargs[index])
        except Exception as exc:  # re-raised in the calling thread below
            errors[index] = exc

    if len(fns) == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(fns))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for index, error in enumerate(errors):
        if error is not None:
            where = f"on {devices[index]}, part {index + 1} of {len(fns)}"
            raise _name_device(error, where) from error
    return results


class GatherMeter:
    """Bytes brought together on the first device since the last forward pass began."""

    def __init__(self) -> None:
        self.bytes = 0

    def reset(self) -> None:
        self.bytes = 0

    def add(self, obj: Any) -> None:
        self.bytes += sum(t.numel() * t.element_size() for t in iter_tensors(obj))
