"""Speed options: torch.compile, channels last, fused optimizer steps. Two tests compile
(inductor on the CPU costs seconds per graph): tiny models, few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.cli import main_in_process
from safetensors.torch import load_file
from torch import nn

import paratrain
from paratrain.checkpoints.state import list_checkpoints
from paratrain.checkpoints.weights import plain_state_dict
from paratrain.cli.main import main
from paratrain.devices.precision import Precision
from paratrain.runtime.compiling import normalize_compile, resolve_mode
from paratrain.runtime.fused import apply_fused
from paratrain.runtime.memory_format import wants_channels_last
from paratrain.runtime.optim import RuntimeOptimizer
from paratrain.runtime.step_state import StepState
from paratrain.strategies import strategy_class
from paratrain.utils.errors import UserError


def _train(capsys: pytest.CaptureFixture[str], out: Path, *argv: str) -> str:
    code, stdout, err = main_in_process(capsys, "train", "--no-progress", "--out", out, *argv)
    assert code == 0, err
    return stdout


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4)
    )


# -- compile -----------------------------------------------------------------------------------
def test_compile_settings_and_modes() -> None:
    assert normalize_compile(True) == "auto" and normalize_compile(False) is None
    assert normalize_compile("max-autotune") == "max-autotune"
    with pytest.raises(UserError, match="valid modes: default, reduce-overhead"):
        normalize_compile("fast")

    def mode(name: str) -> str:
        return strategy_class(name).compile_mode

    assert resolve_mode("auto", mode("cuda")) == "reduce-overhead"  # launch-bound single GPU
    assert resolve_mode("auto", mode("cpu")) == "default"
    assert resolve_mode("auto", mode("ddp")) == "default"
    assert resolve_mode("max-autotune", mode("cpu")) == "max-autotune"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "dp-balanced", "--devices", "cpu,cpu", "--compile"], "runs the model in"),
        (["--strategy", "cpu", "--compile", "reduce-overhead"], "CUDA graphs, which need"),
        (["--strategy", "cpu", "--compile", "turbo"], "unknown compile mode 'turbo'"),
    ],
)
def test_compile_refusals_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    code = main(["train", "--no-progress", "--out", str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(UserError, match="--strategy dp-balanced"):
        paratrain.Runtime(strategy="dp-balanced", devices="cpu,cpu", compile=True, seed=0)


@pytest.mark.slow
def test_compiled_run_keeps_plain_names_and_counts_its_graphs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    torch._dynamo.reset()  # graphs compiled by an earlier test would be reused, not counted
    # 1,000 samples in batches of 300: the last batch (100) is uneven
    argv = ("--recipe", "linear", "--strategy", "cpu", "--batch-size", "300", "--epochs", "2")
    line = _train(capsys, tmp_path / "compiled", *argv, "--compile", "--save-every", "2")
    config = json.loads((tmp_path / "compiled" / "config.json").read_text())
    assert config["runtime"]["compile"] == "default"
    times = config["summary"]["times"]
    # One static graph for the full batches, one for the uneven last: once, not every epoch
    # (evaluation runs the model uncompiled).
    assert times["compiled_graphs"] == 2
    assert times["compile_seconds"] > 0
    assert "2 graph(s) compiled" in line
    checkpoints = list_checkpoints(tmp_path / "compiled")
    for weights in [tmp_path / "compiled", *checkpoints]:
        assert set(load_file(str(weights / "model.safetensors"))) == {"weight", "bias"}
    _train(capsys, tmp_path / "eager", *argv)
    compiled = load_file(str(tmp_path / "compiled" / "model.safetensors"))
    eager = load_file(str(tmp_path / "eager" / "model.safetensors"))
    assert all(torch.allclose(compiled[k], eager[k], rtol=1e-4, atol=1e-5) for k in eager)
    # A compiled run stopped early and resumed loads its plain names back: same weights.
    _train(capsys, tmp_path / "resumed", *argv, "--compile", "--max-steps", "5")
    _train(capsys, tmp_path / "resumed", "--resume", str(tmp_path / "resumed"), "--max-steps", "8")
    resumed = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert all(torch.equal(compiled[k], resumed[k]) for k in compiled)


@pytest.mark.slow
def test_compiled_forward_runs_under_bf16_autocast() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 64)
    with torch.no_grad():
        exact = net(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager_bf16 = net(x).float()
    rt = paratrain.Runtime(strategy="cpu", precision="bf16", compile=True, seed=0)
    model = rt.setup(net)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    with torch.no_grad():
        out = model(x)
    assert out.dtype == torch.float32  # leaves the autocast region as float32
    assert torch.allclose(out, eager_bf16, atol=2e-2)
    assert not torch.allclose(out, exact, atol=1e-4)  # computed in bf16, not float32
    assert not torch._dynamo.utils.counters["graph_break"]
    assert set(plain_state_dict(model)) == {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.mark.slow
def test_ddp_compiles_the_wrapped_model_and_still_skips_gradient_sync() -> None:
    torch.manual_seed(0)
    net, x = nn.Linear(3, 1), torch.randn(4, 3)
    net(x).sum().backward()
    expected = net.weight.grad.clone()
    net.zero_grad()
    rt = paratrain.Runtime(strategy="ddp", devices="cpu", compile=True, seed=0)
    model = rt.setup(net)
    ddp = model._orig_mod  # torch.compile(DDP(model)), as torch recommends
    assert isinstance(ddp, nn.parallel.DistributedDataParallel)
    with rt.accumulate(model):
        rt.backward(model(x).sum())
    assert torch.allclose(net.weight.grad, expected)
    with rt.strategy.no_sync(model):
        assert not ddp.require_backward_grad_sync
    rt.teardown()


# -- channels last ----------------------------------------------------------------------------
def test_channels_last_is_automatic_for_convolutions_on_cuda_only() -> None:
    conv, linear = _conv_net(), nn.Linear(3, 1)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert wants_channels_last(None, conv, cuda) and not wants_channels_last(None, linear, cuda)
    assert not wants_channels_last(None, conv, cpu)
    assert wants_channels_last(True, conv, cpu) and not wants_channels_last(False, conv, cuda)
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    rt.setup(_conv_net())
    assert rt.describe()["channels_last"] is False


def test_channels_last_forced_on_cpu_matches_contiguous() -> None:
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,))
    results = []
    for channels_last in (False, True):
        net = _conv_net()
        seen: list[bool] = []

        def record(_: nn.Module, args: tuple[torch.Tensor], seen: list[bool] = seen) -> None:
            seen.append(args[0].is_contiguous(memory_format=torch.channels_last))

        net[0].register_forward_pre_hook(record)
        rt = paratrain.Runtime(strategy="cpu", channels_last=channels_last, seed=0)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        for _ in range(3):
            rt.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        assert seen == [channels_last] * 3  # the input batches were converted
        assert net[0].weight.is_contiguous(memory_format=torch.channels_last) == channels_last
        results.append(plain_state_dict(model))
    plain, last = results
    assert all(last[k].is_contiguous() for k in last)  # files get ordinary strides
    assert all(torch.allclose(plain[k], last[k], atol=1e-5) for k in plain)


def test_loaded_optimizer_state_takes_the_parameters_layout() -> None:
    source = _conv_net()
    optimizer = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    source(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()  # momentum buffers in ordinary strides
    net = _conv_net()
    rt = paratrain.Runtime(strategy="cpu", channels_last=True, seed=0)
    _, target = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    target.load_state_dict(saved)
    weight = net[0].weight
    loaded = target.state[weight]["momentum_buffer"]
    assert loaded.stride() == weight.stride()
    assert torch.equal(loaded, saved["state"][0]["momentum_buffer"])


# -- fused optimizers -------------------------------------------------------------------------
class _MySGD(torch.optim.SGD):
    pass


def test_fused_rules() -> None:
    params = list(nn.Linear(3, 2).parameters())
    assert apply_fused(torch.optim.SGD(params, lr=0.1), None).startswith("unchanged (param")
    assert apply_fused(torch.optim.SGD(params, lr=0.1), False) == "off"
    chosen = torch.optim.Adam(params, foreach=False)
    assert apply_fused(chosen, None) == "unchanged (Adam was built with foreach=False)"
    assert "SGD, Adam, AdamW" in apply_fused(_MySGD(params, lr=0.1), None)
    with pytest.raises(UserError, match="fused_optimizer=True: Adam was built with foreach"):
        apply_fused(chosen, True)
    optimizer = torch.optim.AdamW(params)
    assert apply_fused(optimizer, True) == "fused"
    assert optimizer.param_groups[0]["fused"] and optimizer.defaults["fused"]
    assert optimizer._step_supports_amp_scaling  # type: ignore[attr-defined]
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert optimizer.param_groups[1]["fused"]


def test_fused_step_is_close_to_the_default_on_cpu() -> None:
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        net = nn.Linear(20, 5)
        rt = paratrain.Runtime(strategy="cpu", fused_optimizer=fused, seed=0)
        model, optimizer = rt.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        assert rt.describe()["fused_optimizer"] == ("fused" if fused else "off")
        for i in range(5):
            torch.manual_seed(i)
            rt.backward(model(torch.randn(8, 20)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        results.append(net.weight.detach().clone())
    # Not bit-identical on the CPU (other rounding): why fused is not automatic there.
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_grad_scaler_hands_its_scale_to_a_fused_optimizer() -> None:
    """GradScaler gives a fused optimizer its scale as attributes; through the runtime's
    optimizer they must reach the real one, or the step applies scaled gradients."""
    steps = []
    for fused in (False, True):
        torch.manual_seed(0)
        net = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, fused=fused)
        precision = Precision("32", torch.device("cpu"))
        precision.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        wrapped = RuntimeOptimizer(optimizer, precision, StepState())
        precision.backward(net(torch.ones(2, 4)).sum())
        wrapped.step()
        steps.append(net.weight.detach().clone())
    assert torch.allclose(steps[0], steps[1], atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_defaults_fuse_and_use_channels_last_and_compile() -> None:
    torch._dynamo.reset()
    net = _conv_net()
    rt = paratrain.Runtime(strategy="cuda", precision="fp16", compile=True, seed=0)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    described = rt.describe()
    assert described["fused_optimizer"] == "fused" and described["channels_last"] is True
    assert described["compile"] == "reduce-overhead"
    x, y = torch.randn(6, 3, 8, 8, device=rt.device), torch.randint(0, 4, (6,), device=rt.device)
    for _ in range(3):
        rt.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert not any(k.startswith("_orig_mod") for k in plain_state_dict(model))
