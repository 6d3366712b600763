"""Deterministic mode: `--deterministic` / `Runtime(deterministic=True, seed=0)`.

It changes process-wide torch settings, so the library-level checks run in a fresh Python
process. On the CPU the defaults are already deterministic; the tests that matter most run
on CUDA (marked ``cuda``), where cuDNN's TF32 convolutions and algorithm choice otherwise
change the weights from one run to the next.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import CLI, subprocess_env
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # real processes, or several layers at work


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_config_json_records_the_numerics_of_every_run(
    paratrain_cli: CLI, paratrain_here: CLI, tmp_path: Path
) -> None:
    common = ("train", "--recipe", "linear", "--strategy", "cpu", "--max-steps", "3")
    common += ("--no-progress",)
    assert paratrain_here(*common, "--out", "plain").returncode == 0
    result = paratrain_cli(*common, "--deterministic", "--out", "exact")
    assert result.returncode == 0, result.stderr
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    exact = json.loads((tmp_path / "exact" / "config.json").read_text())
    assert plain["config"]["deterministic"] is False
    assert plain["runtime"]["numerics"]["deterministic_algorithms"] is False
    assert exact["config"]["deterministic"] is True
    assert exact["runtime"]["numerics"] == {
        "deterministic_algorithms": True,
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "tf32_matmul": False,
        "tf32_cudnn_conv": False,
        "cublas_workspace_config": ":4096:8",
    }
    assert set(plain["runtime"]["numerics"]) == set(exact["runtime"]["numerics"])


def test_runtime_turns_on_deterministic_algorithms_and_turns_off_tf32(tmp_path: Path) -> None:
    result = _python(
        """
        import torch, paratrain
        assert not torch.are_deterministic_algorithms_enabled()
        rt = paratrain.Runtime(strategy="cpu", deterministic=True, seed=0)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert rt.config.deterministic
        assert rt.describe()["numerics"]["tf32_cudnn_conv"] is False
        rebuilt = paratrain.Runtime.from_config(rt.config)  # what spawned processes do
        assert rebuilt.config.deterministic
        print("ok")
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_an_operation_without_a_deterministic_implementation_is_named(tmp_path: Path) -> None:
    """An operation that has no deterministic implementation (as torch's own kernels and
    extensions report it) fails in forward, loss or backward with a one-line error naming
    it, a UserError."""
    result = _python(
        """
        import torch
        from torch import nn
        from torch._prims_common import alert_not_deterministic
        import paratrain


        class Scatter(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                alert_not_deterministic("fancy_scatter_backward")
                return grad


        class InForward(nn.Linear):
            def forward(self, x):
                alert_not_deterministic("fancy_gather_forward")
                return super().forward(x)


        def attempt(model, loss_fn, backward_op=False):
            rt = paratrain.Runtime(strategy="cpu", deterministic=True, seed=0)
            model, loss_fn = rt.setup(model, loss_fn=loss_fn)
            try:
                out = model(torch.randn(4, 3))
                if backward_op:
                    out = Scatter.apply(out)
                rt.backward(loss_fn(out, torch.randn(4, 2)))
            except paratrain.UserError as exc:
                print(type(exc).__name__, exc)


        def noisy_loss(out, target):
            alert_not_deterministic("fancy_loss_kernel")
            return nn.functional.mse_loss(out, target)


        attempt(InForward(3, 2), nn.MSELoss())
        attempt(nn.Linear(3, 2), noisy_loss)
        attempt(nn.Linear(3, 2), nn.MSELoss(), backward_op=True)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3, result.stdout
    for line, op in zip(
        lines, ("fancy_gather_forward", "fancy_loss_kernel", "fancy_scatter_backward"), strict=True
    ):
        assert line.startswith(f"DeterminismError {op} has no deterministic implementation")
        assert "run without it" in line


def test_other_errors_pass_through_unchanged(tmp_path: Path) -> None:
    result = _python(
        """
        import torch, paratrain
        rt = paratrain.Runtime(strategy="cpu", deterministic=True, seed=0)
        model = rt.setup(torch.nn.Linear(3, 2))
        try:
            model(torch.randn(4, 5))
        except RuntimeError as exc:
            print(type(exc).__name__, "mat1 and mat2" in str(exc))
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "RuntimeError True"


def test_same_seed_bit_identical_on_the_cpu_with_and_without(
    paratrain_cli: CLI, tmp_path: Path
) -> None:
    # each in a new process with the same environment: this process's threads differ
    common = ("train", "--recipe", "digits", "--strategy", "cpu", "--max-steps", "20")
    common += ("--no-progress",)
    for out, extra in (("a", ()), ("b", ()), ("c", ("--deterministic",))):
        result = paratrain_cli(*common, *extra, "--out", out)
        assert result.returncode == 0, result.stderr
    a, b, c = (_weights(tmp_path / name) for name in "abc")
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


# -- on a GPU ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["digits", "cifar10-resnet18"])
def test_same_seed_bit_identical_on_cuda(paratrain_cli: CLI, tmp_path: Path, recipe: str) -> None:
    common = ("train", "--recipe", recipe, "--strategy", "cuda", "--deterministic")
    common += ("--max-steps", "30", "--no-progress")
    if recipe == "cifar10-resnet18":
        common += ("--synthetic", "2048", "--cifar-stem", "--batch-size", "64")
    for out in ("a", "b"):
        result = paratrain_cli(*common, "--out", out)
        assert result.returncode == 0, result.stderr
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    print(f"\n{recipe} on cuda, --deterministic, same seed: max diff {_max_diff(a, b):.3g}")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.cuda
def test_cuda_layouts_agree_within_1e5_after_50_steps(paratrain_cli: CLI, tmp_path: Path) -> None:
    common = ("train", "--recipe", "digits", "--deterministic", "--max-steps", "50")
    common += ("--no-progress",)
    layouts = {
        "cuda": ("--strategy", "cuda", "--devices", "1"),
        "ddp1": ("--strategy", "ddp", "--devices", "1"),
        "balanced": ("--strategy", "dp-balanced", "--devices", "cuda:0,cuda:0"),
    }
    for out, layout in layouts.items():
        result = paratrain_cli(*common, *layout, "--out", out)
        assert result.returncode == 0, result.stderr
    reference = _weights(tmp_path / "cuda")
    for out in ("ddp1", "balanced"):
        diff = _max_diff(_weights(tmp_path / out), reference)
        print(f"\n{out} vs cuda, --deterministic, 50 steps: max diff {diff:.3g}")
        assert diff < 1e-5


@pytest.mark.cuda
def test_kill_and_resume_is_bit_identical_on_cuda(paratrain_cli: CLI, tmp_path: Path) -> None:
    common = ("train", "--recipe", "cifar10-resnet18", "--synthetic", "1024", "--cifar-stem")
    common += ("--strategy", "cuda", "--deterministic", "--batch-size", "64", "--epochs", "2")
    common += ("--save-every", "5", "--no-progress")
    assert paratrain_cli(*common, "--out", "ref").returncode == 0
    stopped = paratrain_cli(*common, "--out", "run", "--max-steps", "13")
    assert stopped.returncode == 0, stopped.stderr
    resumed = paratrain_cli("train", "--resume", "run", "--max-steps", "999", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    ref, run = _weights(tmp_path / "ref"), _weights(tmp_path / "run")
    assert all(torch.equal(ref[k], run[k]) for k in ref)
