"""The ddp strategy with real gloo processes: collectives, sharded data, SyncBatchNorm, the
three ways processes start, and device checks made before any process exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CLI, subprocess_env
from helpers.cli import run_paratrain
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.checkpoints.weights import unwrap_model
from paratrain.cli.commands.run import split_own_options
from paratrain.strategies import build_strategy, resolve_auto
from paratrain.training.loop import evaluate
from paratrain.utils.errors import UserError

# -- checks made before any process starts -------------------------------------------------


pytestmark = pytest.mark.slow  # real processes, or several layers at work


def test_devices_resolve_to_cpu_processes_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine a count means GPUs")
    strategy = build_strategy("ddp", "3")
    assert strategy.devices == [torch.device("cpu")] * 3
    assert strategy.num_processes == 3
    assert build_strategy("ddp", "cpu,cpu").num_processes == 2
    assert build_strategy("ddp", None).num_processes == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0", "at least 1"),
        ("-2", "at least 1"),
        ("cuda:97", "cuda:97"),  # no machine has 98 GPUs
        ("cpu,cuda:0", "one kind"),
    ],
)
def test_bad_devices_are_user_errors(spec: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_strategy("ddp", spec)


def test_several_processes_without_a_launcher_is_a_user_error() -> None:
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0)
    with pytest.raises(UserError, match=r"rt\.launch"):
        rt.setup(nn.Linear(2, 2))


def test_a_torchrun_environment_selects_ddp_and_its_process_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in dict(
        RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"
    ).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "1")
    assert resolve_auto(None) == "ddp"
    rt = paratrain.Runtime(devices="cpu,cpu", seed=0)  # nothing joins before setup
    assert (rt.strategy.name, rt.rank, rt.world_size) == ("ddp", 1, 2)
    assert rt.device == torch.device("cpu")  # this process's entry of --devices
    with pytest.raises(UserError, match="launcher started 2"):
        build_strategy("ddp", "cpu,cpu,cpu")
    if not torch.cuda.is_available():  # without --devices: one CPU process per launched one
        assert build_strategy("ddp", None).devices == [torch.device("cpu")] * 2


# -- in the processes --------------------------------------------------------------------


def _collectives_and_data(rt: paratrain.Runtime) -> dict[str, Any]:
    """Collectives, evaluation counts and epoch orders, as seen by rank 0."""
    rank, world = rt.rank, rt.world_size
    out: dict[str, Any] = {"rank": rank, "world": world, "strategy": rt.strategy.name}
    value = torch.tensor([rank + 1.0, -(rank + 1.0)])
    for op in ("sum", "mean", "max", "min"):
        out[op] = rt.all_reduce(value, op).tolist()
    out["input_unchanged"] = value.tolist() == [rank + 1.0, -(rank + 1.0)]
    out["gather"] = [t.item() for t in rt.all_gather(torch.tensor(rank * 10))]
    out["broadcast"] = rt.broadcast_object({"from": rank}, src=world - 1)
    rt.barrier()

    # Evaluation: 1,000 samples, uneven across 3 processes, each counted once.
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(1000, 5, generator=generator), torch.randint(0, 3, (1000,))
    torch.manual_seed(0)
    model = rt.setup(nn.Linear(5, 3))
    test = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=False)
    loss, accuracy = evaluate(
        rt, model, rt.setup_loader(test, evaluation=True), nn.CrossEntropyLoss(), True
    )
    out["eval"] = (loss, accuracy)
    ids = DataLoader(TensorDataset(torch.arange(1000)), batch_size=64, shuffle=False)
    seen = torch.zeros(1000)
    for (batch,) in rt.setup_loader(ids, evaluation=True):
        seen[batch] += 1
    out["seen_counts"] = sorted(set(rt.all_reduce(seen, "sum").tolist()))

    # Training order: reshuffled every epoch without set_epoch, the same global batches
    # on every layout (48 samples, global batch 12: 4 per process with 3 processes).
    train = rt.setup_loader(
        DataLoader(TensorDataset(torch.arange(48)), batch_size=12, shuffle=True)
    )
    orders = []
    for _epoch in range(2):
        local = torch.stack([batch for (batch,) in train])
        parts = rt.all_gather(local)
        orders.append(torch.cat(parts, dim=1).tolist())  # part r of each global batch
    out["orders"] = orders
    return out


def test_collectives_evaluation_and_epoch_order_with_three_processes() -> None:
    three = paratrain.Runtime(strategy="ddp", devices="cpu,cpu,cpu", seed=0).launch(
        _collectives_and_data
    )
    one = paratrain.Runtime(strategy="cpu", seed=0).launch(_collectives_and_data)
    assert three is not None and one is not None
    assert (three["rank"], three["world"], three["strategy"]) == (0, 3, "ddp")
    assert three["sum"] == [6.0, -6.0]
    assert three["mean"] == [2.0, -2.0]
    assert three["max"] == [3.0, -1.0]
    assert three["min"] == [1.0, -3.0]
    assert three["input_unchanged"]
    assert three["gather"] == [0, 10, 20]
    assert three["broadcast"] == {"from": 2}
    assert three["seen_counts"] == [1.0]
    assert three["eval"][1] == one["eval"][1]
    assert three["eval"][0] == pytest.approx(one["eval"][0], abs=1e-6)
    assert three["orders"] == one["orders"]
    assert three["orders"][0] != three["orders"][1]
    assert sorted(i for batch in three["orders"][0] for i in batch) == list(range(48))


def _batchnorm_run(rt: paratrain.Runtime) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=generator) * 3 + 1
    y = torch.randn(64, 1, generator=generator)
    loader = rt.setup_loader(DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    for _epoch in range(2):
        for xb, yb in loader:
            rt.backward(nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
    inner = unwrap_model(model)
    running = rt.all_gather(inner[1].running_mean)
    return {
        "weights": {k: v.detach().cpu() for k, v in inner.state_dict().items()},
        "running_spread": max((r - running[0]).abs().max().item() for r in running),
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_sync_batchnorm_restores_one_process_results() -> None:
    one = paratrain.Runtime(strategy="cpu", seed=0).launch(_batchnorm_run)
    plain = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0).launch(_batchnorm_run)
    synced = paratrain.Runtime(
        strategy="ddp", devices="cpu,cpu", sync_batchnorm=True, seed=0
    ).launch(_batchnorm_run)
    assert one is not None and plain is not None and synced is not None
    plain_diff = _max_diff(one["weights"], plain["weights"])
    synced_diff = _max_diff(one["weights"], synced["weights"])
    print(
        f"\nBatchNorm, ddp 2 vs one process: max abs diff {plain_diff:.3g} without "
        f"--sync-batchnorm, {synced_diff:.3g} with it"
    )
    assert plain["running_spread"] > 1e-3  # each replica kept its own statistics
    assert plain_diff > 1e-3
    assert synced["running_spread"] < 1e-6
    assert synced_diff < 1e-5


# -- started by torchrun -------------------------------------------------------------------


def test_torchrun_starts_paratrain_train(paratrain_cli: CLI, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_paratrain(
        *("train", "--strategy", "ddp", "--devices", "cpu,cpu", "--max-steps", "5"),
        *("--no-progress", "--out", str(out)),
        torchrun=("--standalone", "--nproc-per-node", "2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("trained 0.1 epochs, 5 steps") == 1  # rank 0 only
    config = json.loads((out / "config.json").read_text())
    assert config["status"] == "finished"
    assert config["runtime"]["strategy"] == "ddp"
    assert config["runtime"]["world_size"] == 2
    assert load_file(str(out / "model.safetensors"))


def test_paratrain_run_starts_a_user_script(paratrain_cli: CLI, tmp_path: Path) -> None:
    script = tmp_path / "train_me.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys
            import torch
            from torch import nn
            from torch.utils.data import DataLoader, TensorDataset
            import paratrain

            rt = paratrain.Runtime(strategy="auto", seed=0)
            torch.manual_seed(0)
            model = nn.Linear(3, 1)
            model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            x = torch.arange(24.0).reshape(8, 3) / 24
            data = TensorDataset(x, x.sum(1, keepdim=True))
            loader = rt.setup_loader(DataLoader(data, batch_size=4))
            for xb, yb in loader:
                rt.backward(nn.functional.mse_loss(model(xb), yb))
                optimizer.step()
                optimizer.zero_grad()
            rt.print("done on", rt.world_size)
            if rt.is_main:
                weights = [p.detach().flatten().tolist() for p in model.parameters()]
                info = {"strategy": rt.strategy.name, "world": rt.world_size, "weights": weights,
                        "threads": torch.get_num_threads(),
                        "threads_chosen": rt.describe()["threads"]}
                open(sys.argv[1], "w").write(json.dumps(info))
            """
        )
    )
    # Nobody set OMP_NUM_THREADS: paratrain chooses (one thread each on two cores), before
    # torchrun would warn and choose 1 itself.
    env = {k: v for k, v in subprocess_env().items() if k not in ("OMP_NUM_THREADS",)}
    result = paratrain_cli(
        "run",
        str(script),
        str(tmp_path / "ddp.json"),
        "--strategy",
        "ddp",
        "--devices",
        "cpu,cpu",
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done on 2") == 1
    assert "Setting OMP_NUM_THREADS" not in result.stderr  # torchrun's four-line warning
    # paratrain says once what it set, in the launcher (not once per process)
    assert result.stderr.count("paratrain: note: OMP_NUM_THREADS=") == 1, result.stderr
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    assert (ddp["strategy"], ddp["world"]) == ("ddp", 2)
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert 1 <= ddp["threads"] == ddp["threads_chosen"]["threads"] <= share
    assert ddp["threads_chosen"]["wait_policy"] == "PASSIVE"
    # The same script without any launcher: one process on the CPU (where auto would pick a
    # GPU, PARATRAIN_STRATEGY says cpu), the same weights.
    plain = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "one.json")],
        env=subprocess_env(PARATRAIN_STRATEGY="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    one = json.loads((tmp_path / "one.json").read_text())
    assert (one["strategy"], one["world"]) == ("cpu", 1)
    diff = max(
        abs(a - b)
        for p, q in zip(one["weights"], ddp["weights"], strict=True)
        for a, b in zip(p, q, strict=True)
    )
    assert diff < 1e-6


def test_paratrain_run_options_may_follow_the_script() -> None:
    own = split_own_options(
        ["--lr", "3", "--strategy=ddp", "--devices", "2", "--", "--devices", "9"], "auto", None
    )
    assert own == ("ddp", "2", ["--lr", "3", "--devices", "9"])


# -- GPUs ----------------------------------------------------------------------------------


def _gpu_run(rt: paratrain.Runtime) -> dict[str, Any]:
    model = rt.setup(nn.Linear(4, 2))
    total = rt.all_reduce(torch.ones(2, device=rt.device), "sum")
    index = torch.tensor([next(model.parameters()).device.index], device=rt.device)
    return {
        "backend": rt.strategy.describe()["backend"],
        "device": str(next(model.parameters()).device),
        "total": total.tolist(),
        "devices": [int(t.item()) for t in rt.all_gather(index)],
    }


@pytest.mark.cuda
def test_ddp_on_one_gpu_uses_nccl() -> None:
    result = paratrain.Runtime(strategy="ddp", devices="cuda:0", seed=0).launch(_gpu_run)
    assert result == {"backend": "nccl", "device": "cuda:0", "total": [1.0, 1.0], "devices": [0]}


@pytest.mark.cuda
@pytest.mark.cuda2
def test_a_count_and_auto_mean_gpus_where_there_are_two() -> None:
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert build_strategy("ddp", "2").devices == gpus
    assert build_strategy("auto", "2").devices == gpus
    assert build_strategy("auto", "1").name == "cuda"  # one device named: no processes
    assert build_strategy("auto", None).num_processes == torch.cuda.device_count()


@pytest.mark.cuda
@pytest.mark.cuda2
def test_ddp_on_two_gpus_runs_one_process_per_gpu() -> None:
    result = paratrain.Runtime(strategy="ddp", devices="0,1", seed=0).launch(_gpu_run)
    assert result == {
        "backend": "nccl",
        "device": "cuda:0",
        "total": [2.0, 2.0],
        "devices": [0, 1],
    }
