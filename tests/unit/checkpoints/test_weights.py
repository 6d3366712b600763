"""Plain weights (paratrain.checkpoints.weights) in this process: wrappers unwrapped,
prefixes stripped, tied tensors saved apart, and a sharded model's weights written by the
main process (`--strategy cpu`; DDP and a sharded model on a real gloo group of one process)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from conftest import cpu_data_parallel
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from paratrain.checkpoints.weights import (
    plain_state_dict,
    plain_tensors,
    save_weights,
    strip_prefixes,
    unwrap_model,
)


def _group_of_one() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_prefixes_are_stripped_in_any_order_and_only_at_the_start() -> None:
    assert strip_prefixes("module._orig_mod.module.fc.w") == "fc.w"
    assert strip_prefixes("_orig_mod.module._orig_mod.fc.w") == "fc.w"
    assert strip_prefixes("fc.module.w") == "fc.module.w"
    assert strip_prefixes("modules.w") == "modules.w"


class _Compiled(nn.Module):
    """What ``torch.compile`` returns, as far as names go (``_orig_mod``): importing dynamo
    costs seconds, and test_load_weights.py loads into really compiled models."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


class _Holder(nn.Module):
    """A user's module with a submodule named ``module``: not a wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)


def test_wrappers_are_unwrapped_in_any_nesting() -> None:
    inner = nn.Linear(2, 2)
    assert unwrap_model(_Compiled(cpu_data_parallel(_Compiled(inner)))) is inner
    holder = _Holder()
    assert unwrap_model(holder) is holder
    _group_of_one()
    ddp = DistributedDataParallel(inner)
    assert unwrap_model(_Compiled(ddp)) is inner
    assert list(plain_state_dict(_Compiled(ddp))) == ["weight", "bias"]


def test_plain_tensors_are_detached_contiguous_and_apart() -> None:
    weight = nn.Parameter(torch.arange(6.0).reshape(2, 3))
    state = {"module.a": weight, "b": weight, "c": torch.arange(6.0).reshape(3, 2).t()}
    plain = plain_tensors(state)
    assert list(plain) == ["a", "b", "c"]
    assert not plain["a"].requires_grad and plain["c"].is_contiguous()
    assert plain["a"].data_ptr() != plain["b"].data_ptr()  # safetensors refuses shared storage
    assert plain["a"].data_ptr() == weight.data_ptr()  # only the second of a tie is copied
    assert torch.equal(plain["b"], weight.detach()) and torch.equal(plain["c"], state["c"])


def test_saved_weights_are_plain_safetensors(tmp_path: Path) -> None:
    inner = nn.Linear(2, 3)
    save_weights(_Compiled(inner), tmp_path / "model.safetensors")
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved.keys() == {"weight", "bias"} and torch.equal(saved["bias"], inner.bias.detach())
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as opened:
        assert opened.metadata() == {"format": "pt"}


def test_a_sharded_models_weights_are_gathered_and_written_by_the_main_process(
    tmp_path: Path,
) -> None:
    _group_of_one()
    mesh = init_device_mesh("cpu", (1,))
    model = nn.Linear(4, 2)
    full_weight = model.weight.detach().clone()
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    save_weights(model, tmp_path / "model.safetensors")
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(saved["weight"], full_weight)
