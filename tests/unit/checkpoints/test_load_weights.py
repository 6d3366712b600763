"""paratrain.load_weights: every foreign format into every layout, and readable mismatches."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import cpu_data_parallel
from safetensors.torch import save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import paratrain
from paratrain.checkpoints.files import LoadReport, WeightsMismatchError, read_checkpoint
from paratrain.checkpoints.weights import save_weights, unwrap_model
from paratrain.launching.launch import free_port
from paratrain.training import rundir
from paratrain.utils.errors import UserError

# torch.compile's imports warn about TorchScript; nothing here uses it
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Net(nn.Module):
    """Small, but with buffers (BatchNorm) and nested names."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)))


def reference() -> Net:
    torch.manual_seed(1)
    net = Net()
    with torch.no_grad():  # buffers too must travel, so make them differ from a fresh model
        net.bn.running_mean.uniform_()
        net.bn.running_var.uniform_(1, 2)
        net.bn.num_batches_tracked.fill_(7)
    return net


def fresh(seed: int = 2) -> Net:
    torch.manual_seed(seed)
    return Net()


def assert_same_weights(model: nn.Module, ref: nn.Module) -> None:
    got, want = unwrap_model(model).state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + key: value for key, value in state.items()}


# -- sources: built once per module (torch.compile's first import costs seconds) -------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sources")
    ref = reference()
    bare = ref.state_dict()
    built: dict[str, Any] = {}

    def save(name: str, obj: Any) -> Path:
        torch.save(obj, root / name)
        return root / name

    built["bare .pt"] = save("bare.pt", bare)
    built["module. (DataParallel)"] = save("dp.pth", cpu_data_parallel(ref).state_dict())
    built["_orig_mod. (compile)"] = save("compiled.bin", torch.compile(ref).state_dict())
    built["module._orig_mod."] = save("dp_c.pt", cpu_data_parallel(torch.compile(ref)).state_dict())
    built["_orig_mod.module."] = save("c_dp.pt", torch.compile(cpu_data_parallel(ref)).state_dict())
    built["{'state_dict': ...}"] = save("sd.pt", {"state_dict": bare, "epoch": 4})
    built["{'model': ...}"] = save(
        "model.pt", {"model": prefixed(bare, "module."), "optimizer": {"state": {}}, "step": 9}
    )
    built["lightning model. prefix"] = save(
        "last.ckpt",
        {"state_dict": prefixed(bare, "model."), "epoch": 2, "global_step": 40, "loops": {}},
    )
    save_file({k: v.contiguous() for k, v in bare.items()}, str(root / "model.safetensors"))
    built["safetensors"] = root / "model.safetensors"
    run = root / "run"
    run.mkdir()
    save_weights(cpu_data_parallel(ref), run / rundir.WEIGHTS)
    rundir.write_config(run, {"status": "finished", "runtime": {"world_size": 1}})
    built["paratrain run dir"] = run
    step = run / "checkpoints" / "step-000012"
    step.mkdir(parents=True)
    save_weights(ref, step / "model.safetensors")
    torch.save({"state": {}, "param_groups": []}, step / "optimizer.pt")
    (step / "state.json").write_text(json.dumps({"epoch": 1, "step": 12, "world_size": 2}))
    built["paratrain checkpoint dir"] = step
    built["in-memory dict"] = cpu_data_parallel(ref).state_dict()
    return built


SOURCE_NAMES = [
    "bare .pt",
    "module. (DataParallel)",
    "_orig_mod. (compile)",
    "module._orig_mod.",
    "_orig_mod.module.",
    "{'state_dict': ...}",
    "{'model': ...}",
    "lightning model. prefix",
    "safetensors",
    "paratrain run dir",
    "paratrain checkpoint dir",
    "in-memory dict",
]


# -- layouts ---------------------------------------------------------------------------------


@pytest.fixture
def gloo_group() -> Iterator[None]:
    """A real one-process gloo group in this process, torn down after the test."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _ddp(model: nn.Module) -> nn.Module:
    assert dist.is_initialized()
    return DistributedDataParallel(model)


LAYOUTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "bare": lambda m: m,
    "DataParallel": cpu_data_parallel,
    "DDP (gloo)": _ddp,
    "compiled": lambda m: torch.compile(m),  # wrapped, never run: no compiler needed
}


def test_the_dataparallel_layout_is_a_real_one_left_on_the_cpu() -> None:
    model = fresh()
    wrapped = cpu_data_parallel(model)
    assert isinstance(wrapped, nn.DataParallel) and unwrap_model(wrapped) is model
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}
    assert list(wrapped.state_dict()) == [f"module.{key}" for key in model.state_dict()]


def _load_in_rank(rt: paratrain.Runtime, path: str) -> bool:
    """Runs in each of the ddp processes: load into the DDP model rt.setup made."""
    model = rt.setup(fresh(seed=10 + rt.rank))
    assert isinstance(model, DistributedDataParallel)
    assert paratrain.load_weights(model, path).ok
    assert_same_weights(model, reference())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = rt.all_gather(flat)
    return torch.equal(gathered[0], gathered[1])


@pytest.mark.slow
def test_loads_into_ddp_in_two_gloo_processes(sources: dict[str, Any]) -> None:
    """Every rank reads the same DataParallel-saved file into its DDP model."""
    path = str(sources["module. (DataParallel)"])
    runtime = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0)
    assert runtime.launch(_load_in_rank, path) is True


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("source", SOURCE_NAMES)
def test_every_format_loads_into_every_layout(
    sources: dict[str, Any], request: pytest.FixtureRequest, source: str, layout: str
) -> None:
    if layout.startswith("DDP"):
        request.getfixturevalue("gloo_group")
    model = LAYOUTS[layout](fresh())
    ref = reference()
    report = paratrain.load_weights(model, sources[source])
    assert isinstance(report, LoadReport) and report.ok
    assert sorted(report.loaded) == sorted(ref.state_dict())
    # wrapper prefixes are matched as such, not guessed as a renamed prefix
    assert bool(report.hints) == (source == "lightning model. prefix")
    assert_same_weights(model, ref)


def test_lightning_prefix_is_removed_with_a_hint(sources: dict[str, Any]) -> None:
    report = paratrain.load_weights(fresh(), sources["lightning model. prefix"])
    assert report.ok
    assert any("'model.'" in hint for hint in report.hints)
    assert report.source.endswith("last.ckpt['state_dict']")


def test_a_prefix_the_model_carries_is_added() -> None:
    class Holder(nn.Module):  # e.g. a LightningModule-like wrapper with self.model
        def __init__(self) -> None:
            super().__init__()
            self.model = fresh()

    holder = Holder()
    report = paratrain.load_weights(holder, reference().state_dict())
    assert report.ok and any("added the prefix 'model.'" in h for h in report.hints)
    assert_same_weights(holder.model, reference())


def test_a_submodule_really_named_module_survives_wrapper_stripping() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    torch.manual_seed(0)
    source = Holder()
    saved = cpu_data_parallel(source).state_dict()
    assert list(saved) == ["module.module.weight", "module.module.bias"]
    target = Holder()
    paratrain.load_weights(target, saved)
    assert torch.equal(target.module.weight, source.module.weight)


def test_a_compiled_submodule_loads_into_a_plain_one() -> None:
    class Outer(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.enc = inner

    ref = reference()
    saved = Outer(torch.compile(ref)).state_dict()
    assert "enc._orig_mod.conv.weight" in saved
    target = Outer(fresh())
    assert paratrain.load_weights(target, saved).ok
    assert_same_weights(target.enc, ref)


@pytest.mark.slow
def test_a_module_is_a_source_too() -> None:
    target = fresh()
    paratrain.load_weights(target, nn.DataParallel(reference()))
    assert_same_weights(target, reference())


# -- mismatches ------------------------------------------------------------------------------


def mismatched_state() -> dict[str, torch.Tensor]:
    state = prefixed(reference().state_dict(), "module.")
    del state["module.bn.running_var"]
    state["module.extra.weight"] = torch.ones(4, 4)
    return state


def test_strict_mismatch_raises_a_table_and_loads_nothing() -> None:
    model = fresh(seed=3)
    model.head[1] = nn.Linear(8, 5)  # five classes instead of three
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsMismatchError) as caught:
        paratrain.load_weights(cpu_data_parallel(model), mismatched_state())
    assert isinstance(caught.value, UserError)
    message = str(caught.value)
    lines = message.splitlines()
    assert "1 missing, 1 unexpected, 2 shape mismatches" in lines[0]
    assert any(line.split()[:3] == ["bn.running_var", "missing", "-"] for line in lines)
    assert any(line.split()[:2] == ["module.extra.weight", "unexpected"] for line in lines)
    assert any("head.1.weight" in line and "(3, 8)" in line and "(5, 8)" in line for line in lines)
    assert "KeyError" not in message
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[key]), f"{key} changed by a refused load"


def test_not_strict_loads_what_matches_and_reports_the_rest() -> None:
    model = fresh(seed=3)
    model.head[1] = nn.Linear(8, 5)
    untouched = model.head[1].weight.clone()
    report = paratrain.load_weights(model, mismatched_state(), strict=False)
    assert report.missing == ["bn.running_var"]
    assert report.unexpected == ["module.extra.weight"]
    assert [(m.key, m.checkpoint_shape, m.model_shape) for m in report.mismatched] == [
        ("head.1.weight", (3, 8), (5, 8)),
        ("head.1.bias", (3,), (5,)),
    ]
    assert not report.ok
    ref = reference()
    assert sorted(report.loaded) == sorted(
        k for k in ref.state_dict() if k not in {"bn.running_var", "head.1.weight", "head.1.bias"}
    )
    assert torch.equal(model.conv.weight, ref.conv.weight)
    assert torch.equal(model.bn.running_mean, ref.bn.running_mean)
    assert torch.equal(model.head[1].weight, untouched)
    assert "strict=False loads the" in str(report)


def test_lightning_prefix_with_extra_keys_still_matches_the_model() -> None:
    state = prefixed(reference().state_dict(), "model.")
    state["criterion.weight"] = torch.ones(3)  # a loss module's buffer, not the network's
    with pytest.raises(WeightsMismatchError, match=r"removed the prefix 'model\.'") as caught:
        paratrain.load_weights(fresh(), state)
    assert "criterion.weight" in str(caught.value)
    model = fresh()
    report = paratrain.load_weights(model, state, strict=False)
    assert report.unexpected == ["criterion.weight"] and not report.missing
    assert_same_weights(model, reference())


def test_a_checkpoint_of_another_model_says_so() -> None:
    with pytest.raises(WeightsMismatchError, match="another model"):
        paratrain.load_weights(fresh(), nn.GRU(3, 3).state_dict())


def test_long_lists_are_cut_in_the_table() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(30)])
    with pytest.raises(WeightsMismatchError) as caught:
        paratrain.load_weights(model, {"w": torch.ones(1)})
    assert "60 missing" in str(caught.value)
    assert "... and 40 more missing" in str(caught.value)
    assert len(str(caught.value).splitlines()) < 30


def test_older_checkpoint_without_batchnorm_counters_gets_a_hint() -> None:
    state = {k: v for k, v in reference().state_dict().items() if "num_batches" not in k}
    report = paratrain.load_weights(fresh(), state, strict=False)
    assert report.missing == ["bn.num_batches_tracked"]
    assert any("num_batches_tracked" in hint for hint in report.hints)


def test_sources_that_hold_no_weights_are_refused(tmp_path: Path) -> None:
    torch.save({"optimizer": {"state": {}}, "epoch": 3}, tmp_path / "opt.pt")
    with pytest.raises(UserError, match="holds no tensors: its top-level keys are optimizer"):
        paratrain.load_weights(fresh(), tmp_path / "opt.pt")
    with pytest.raises(UserError, match="cannot load weights from a list"):
        paratrain.load_weights(fresh(), [1, 2])  # type: ignore[arg-type]


def test_training_state_is_read_from_state_json(sources: dict[str, Any]) -> None:
    checkpoint = read_checkpoint(sources["paratrain checkpoint dir"])
    assert checkpoint.training_state == {"epoch": 1, "step": 12, "world_size": 2}
    assert checkpoint.file is not None and checkpoint.file.name == "model.safetensors"
    lightning = read_checkpoint(sources["lightning model. prefix"])
    assert lightning.training_state == {"epoch": 2, "global_step": 40}
    assert lightning.other_entries == ["loops"]
