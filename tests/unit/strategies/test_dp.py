"""dp (nn.DataParallel): device resolution and errors here, training on GPUs where present."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

import paratrain
from paratrain.cli import main as cli
from paratrain.strategies import build_strategy
from paratrain.strategies import dp as dp_module
from paratrain.training.config import TrainConfig
from paratrain.training.recipes import get_recipe
from paratrain.utils.errors import UserError


def _error(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> str:
    assert cli.main(["train", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratrain: error:") and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    return err


def test_dp_without_cuda_suggests_the_cpu_code_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for devices in ([], ["--devices", "2"], ["--devices", "cuda:0,cuda:1"]):
        err = _error(capsys, tmp_path, "--strategy", "dp", *devices)
        assert "--strategy dp-balanced --devices cpu,cpu" in err and "auto" in err


@pytest.mark.parametrize("devices", ["0", "-1", "cpu,cpu", "cuda:0,cpu", "cuda:96"])
def test_dp_bad_devices_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], devices: str
) -> None:
    err = _error(capsys, tmp_path, "--strategy", "dp", "--devices", devices)
    if torch.cuda.is_available():  # without CUDA every case says so (tested above)
        expected = {"0": "at least 1", "-1": "at least 1", "cuda:96": "does not exist"}
        assert expected.get(devices, "runs on CUDA GPUs") in err


def test_device_lists_on_a_machine_with_four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_module, "cuda_count", lambda: 4)
    cuda = [torch.device("cuda", i) for i in range(4)]
    for name in ("dp", "dp-balanced"):
        assert build_strategy(name, None).devices == cuda
        assert build_strategy(name, "4").devices == cuda
        assert build_strategy(name, 2).devices == cuda[:2]
        assert build_strategy(name, "0,1").devices == cuda[:2]
        assert build_strategy(name, "cuda:0,cuda:1").devices == cuda[:2]
        assert build_strategy(name, "cuda:0,cuda:0").devices == [cuda[0], cuda[0]]
        assert build_strategy(name, "cuda:3, 2").devices == [cuda[3], cuda[2]]
        with pytest.raises(UserError, match="more GPUs than this machine has"):
            build_strategy(name, "5")
        with pytest.raises(UserError, match="cuda:4 does not exist"):
            build_strategy(name, "0,4")
    assert build_strategy("dp-balanced", "cpu,cpu").devices == [torch.device("cpu")] * 2
    with pytest.raises(UserError, match="runs on CUDA GPUs"):
        build_strategy("dp", "cpu,cpu")


# -- on GPUs ---------------------------------------------------------------------------------
def _digits(tmp_path: Path, name: str, *strategy: str) -> dict[str, torch.Tensor]:
    out = tmp_path / name
    argv = ["train", "--recipe", "digits", *strategy, "--max-steps", "50", "--no-progress"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    return load_file(str(out / "model.safetensors"))


@pytest.mark.cuda
def test_dp_and_balanced_on_a_repeated_gpu_match_one_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch split over the replicas and their gradients summed back train one GPU's
    model. Compared with one GPU, not the CPU: a GPU's fp32 kernels round otherwise (cuDNN
    picks its own convolution algorithms) and 50 steps grow it; dp on cuda:0,cuda:0 ended
    7.2e-4 from cpu on an H200, TF32 off (docs/reproducibility.md)."""
    # fp32 sums alone: no TF32 (10-bit mantissas in every convolution), and no cuDNN
    # algorithm whose atomics sum in another order from one run to the next.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    reference = _digits(tmp_path, "cuda", "--strategy", "cuda")
    for name in ("dp", "dp-balanced"):
        weights = _digits(tmp_path, name, "--strategy", name, "--devices", "cuda:0,cuda:0")
        assert weights.keys() == reference.keys()
        diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
        with capsys.disabled():
            print(f"\ndigits, 50 steps, fp32: max |{name} cuda:0,cuda:0 - cuda| = {diff:.2e}")
        # halves then a sum of two replicas' gradients, against one sum: a rounding apart
        # (within 1e-5 under --deterministic on an H100, docs/reproducibility.md)
        assert diff < 1e-4


@pytest.mark.cuda
def test_dp_replicas_run_under_the_callers_autocast_dtype() -> None:
    dtypes: list[torch.dtype] = []

    class Probe(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            dtypes.append(out.dtype)
            return out

    rt = paratrain.Runtime(strategy="dp", devices="cuda:0,cuda:0", precision="bf16", seed=0)
    model = rt.setup(Probe(4, 2))
    out = model(torch.randn(6, 4, device=rt.device))
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # torch's own threads would use fp16
    assert out.dtype == torch.float32  # cast after the gather, which moved bf16 values
    assert rt.strategy.gathered_bytes_per_step() == 6 * 2 * 2  # type: ignore[attr-defined]


def _peak_memory(name: str, devices: str) -> tuple[list[int], int]:
    """Peak bytes allocated on each distinct device over three ResNet-18 steps, and the
    bytes gathered on the first device in the last step."""
    cfg = TrainConfig(
        recipe="cifar10-resnet18", synthetic=512, strategy=name, devices=devices, progress=False
    ).resolved(get_recipe)
    rt = paratrain.Runtime.from_config(cfg.runtime_config())
    recipe = get_recipe(cfg.recipe)
    train_set, _ = recipe.build_data(cfg)
    model = recipe.build_model(cfg)
    optimizer = recipe.build_optimizer(model.parameters(), cfg)
    model, optimizer, loss_fn = rt.setup(model, optimizer, recipe.build_loss())
    loader = rt.setup_loader(DataLoader(train_set, batch_size=256, shuffle=True, drop_last=True))
    distinct = list(dict.fromkeys(rt.strategy.devices))
    for device in distinct:
        torch.cuda.reset_peak_memory_stats(device)
    for _, (x, y) in zip(range(3), loader, strict=False):
        loss = loss_fn(model(x), y)
        rt.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    peaks = [torch.cuda.max_memory_allocated(device) for device in distinct]
    gathered: int = rt.strategy.gathered_bytes_per_step()  # type: ignore[attr-defined]
    del model, optimizer, loss_fn, loader
    gc.collect()
    torch.cuda.empty_cache()
    return peaks, gathered


@pytest.mark.cuda
def test_first_device_memory_dp_vs_balanced(capsys: pytest.CaptureFixture[str]) -> None:
    count = torch.cuda.device_count()
    devices = ",".join(str(i) for i in range(count)) if count >= 2 else "cuda:0,cuda:0"
    dp_peaks, dp_gathered = _peak_memory("dp", devices)
    balanced_peaks, balanced_gathered = _peak_memory("dp-balanced", devices)
    with capsys.disabled():
        mib = 2**20
        print(f"\ncifar10-resnet18, batch 256 on {devices}: peak MiB per device, gathered bytes")
        print(f"  dp          {[round(p / mib) for p in dp_peaks]}  {dp_gathered}")
        print(f"  dp-balanced {[round(p / mib) for p in balanced_peaks]}  {balanced_gathered}")
    parts = len(devices.split(","))
    assert dp_gathered == 256 * 10 * 4  # every logit, float32
    assert balanced_gathered == parts * 4  # one float32 loss per device
    assert min(dp_peaks + balanced_peaks) > 0
