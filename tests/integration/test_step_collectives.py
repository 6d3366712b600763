"""Each training step pays one small all-reduce besides the gradient sync: the step's
agreement (paratrain.runtime.agreement) carries the non-finite check, --oom auto's
out-of-memory flag and the stop on a signal. Counted with torch's profiler, which records
every gloo collective with its shape, in one real run of `--strategy ddp --devices cpu,cpu`
(two gloo processes): a user's loop (rt.backward, rt.should_stop), the same loop through
rt.forward_backward with --oom auto, and `paratrain train`'s loop (--profile); and under
`--strategy pipeline --devices cpu,cpu`, where the agreement also brings the last stage's
loss to every process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import subprocess_env
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.launching import preemption
from paratrain.runtime.agreement import SLOTS, StepAgreement
from paratrain.training.config import TrainConfig
from paratrain.training.loop import train
from paratrain.training.recipes import get_recipe
from paratrain.utils.errors import LaunchError, NonFiniteLossError

pytestmark = pytest.mark.slow  # real processes, or several layers at work


AGREEMENT = len(SLOTS)  # the agreement's numbers (paratrain.runtime.agreement)
GRADIENTS = 6 * 8 + 8 + 8 * 1 + 1  # the model's parameters: DDP's one bucket
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))


def _collectives(prof: Any) -> list[tuple[str, int]]:
    """Every gloo collective the profiler saw: its name and how many numbers it moved."""
    found = []
    for event in prof.events():
        if event.name.startswith("gloo:"):
            dims = event.input_shapes[0] if event.input_shapes else []
            found.append((event.name, int(torch.Size(dims).numel()) if dims else 0))
    return found


def _profiled(step: Callable[[], None]) -> Counter[tuple[str, int]]:
    for _ in range(2):  # warm-up: DDP rebuilds its buckets and broadcasts their order
        step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            step()
    return Counter(_collectives(prof))


def _trace_collectives_per_step(folder: Path) -> list[Counter[tuple[str, int]]]:
    """From ``--profile``'s trace of rank 0: the gloo collectives of each profiled step."""
    (path,) = folder.glob("rank0*.json")
    events = json.loads(path.read_text())["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    per_step: list[Counter[tuple[str, int]]] = []
    for window in sorted(steps, key=lambda e: e["ts"]):
        begin, end = window["ts"], window["ts"] + window["dur"]
        inside = Counter[tuple[str, int]]()
        for e in events:
            name = str(e.get("name", ""))
            if name.startswith("gloo:") and begin <= e["ts"] < end:
                dims = (e.get("args", {}).get("Input Dims") or [[]])[0]
                inside[(name, int(torch.Size(dims).numel()) if dims else 0)] += 1
        per_step.append(inside)
    return per_step


def _run(rt: paratrain.Runtime, out: str) -> dict[str, Any]:
    model = _model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(rt.rank)
    x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 1, generator=generator)
    stops: list[bool] = []

    def own_step() -> None:  # a user's loop
        optimizer.zero_grad()
        rt.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        stops.append(rt.should_stop())

    def pieces_step() -> None:  # rt.forward_backward under --oom auto
        optimizer.zero_grad()
        rt.forward_backward(model, nn.functional.mse_loss, x, y)
        optimizer.step()
        stops.append(rt.should_stop())

    result: dict[str, Any] = {"own": _profiled(own_step), "pieces": _profiled(pieces_step)}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        rt.should_stop()  # no step since the last call: an agreement of its own
        rt.should_stop()
    result["stop_alone"] = Counter(_collectives(prof))

    # A signal after a step's agreement, on rank 1 only: every rank stops after the next step.
    signalled_at = len(stops)
    if rt.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    while not stops[-1]:
        own_step()
    result["stopped_after"] = [int(s) for s in rt.all_gather(torch.tensor([len(stops)]))]
    result["signalled_at"] = signalled_at
    result["stop_seen_by"] = [
        int(s) for s in rt.all_gather(torch.tensor([int(rt._groups.stop._stop is not None)]))
    ]
    with contextlib.suppress(preemption.Stopped):
        rt.exit_stopped()  # forgets the stop: a later loop runs on

    # paratrain train's loop: --oom auto (its default), --profile of 4 steps after one
    cfg = TrainConfig(recipe="linear", strategy="ddp", devices="cpu,cpu", max_steps=STEPS + 3)
    cfg = replace(cfg, profile=STEPS + 1, progress=False)
    cfg = cfg.resolved(get_recipe)
    train(rt, cfg, Path(out))
    if rt.is_main:
        result["train"] = _trace_collectives_per_step(Path(out) / "profile")
    return result


def test_one_small_all_reduce_per_step_and_every_rank_stops_together(tmp_path: Path) -> None:
    """--strategy ddp --devices cpu,cpu."""
    (tmp_path / "run").mkdir()
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0, oom="auto")
    result = rt.launch(_run, str(tmp_path / "run"))
    assert result is not None
    agreement, gradients = ("gloo:all_reduce", AGREEMENT), ("gloo:all_reduce", GRADIENTS)
    each_step = Counter({agreement: STEPS, gradients: STEPS})
    assert result["own"] == each_step, result["own"]
    assert result["pieces"] == each_step, result["pieces"]
    assert result["stop_alone"] == Counter({agreement: 2})
    # rank 1's signal came after step N's agreement: both ranks stop after step N + 1
    assert result["stopped_after"] == [result["signalled_at"] + 1] * 2, result
    assert result["stop_seen_by"] == [1, 1]
    # the first profiled step (the run's second) holds DDP's broadcast of its rebuilt
    # buckets' order, once per run
    per_step = result["train"][1:]
    assert len(per_step) == STEPS
    for counted in per_step:  # the linear recipe: 11 parameters, one bucket
        assert counted == Counter({agreement: 1, ("gloo:all_reduce", 11): 1}), per_step


def test_one_process_agreement_needs_no_collective() -> None:
    """--strategy cpu: the verdict is this process's own."""
    agreement = StepAgreement()
    collective = paratrain.Runtime(strategy="cpu").strategy.collective
    verdict = agreement.exchange(collective, 3, "here", bad=torch.tensor(True), failed=True)
    assert verdict.bad and verdict.failed and agreement.count == 0


def _pipeline_run(rt: paratrain.Runtime) -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(0)  # every stage gets the batch (rt.setup_loader)
    x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 1, generator=generator)
    losses: list[torch.Tensor] = []

    def step() -> None:
        optimizer.zero_grad()
        losses.append(rt.forward_backward(model, nn.functional.mse_loss, x, y))
        optimizer.step()
        rt.should_stop()

    counted = _profiled(step)
    return {
        "collectives": Counter({k: n for k, n in counted.items() if k[0] in _GROUP_WIDE}),
        "losses": [rt.all_gather(loss.reshape(1), over="processes") for loss in losses],
    }


#: the collectives every process joins (a pipeline's stages also send to each other)
_GROUP_WIDE = ("gloo:all_reduce", "gloo:broadcast", "gloo:all_gather", "gloo:barrier")


def test_a_pipeline_step_pays_one_small_all_reduce_and_every_stage_has_the_loss() -> None:
    """--strategy pipeline --devices cpu,cpu."""
    rt = paratrain.Runtime(strategy="pipeline", devices="cpu,cpu", seed=0)
    result = rt.launch(_pipeline_run)
    assert result is not None
    assert result["collectives"] == Counter({("gloo:all_reduce", AGREEMENT): STEPS})
    for first, last in result["losses"]:
        assert torch.equal(first, last) and torch.isfinite(first).all()
    assert result["losses"][0][0] != result["losses"][-1][0]  # trained: the loss moved


def _fsdp_run(rt: paratrain.Runtime) -> dict[str, Counter[tuple[str, int]]]:
    model = _model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(rt.rank)
    x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 1, generator=generator)

    def step(stop: bool) -> None:
        optimizer.zero_grad()
        rt.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        if stop:
            rt.should_stop()

    full = _profiled(lambda: step(True))
    rt.nonfinite.policy = "off"  # no check, no stop: the gathers and gradients alone
    return {"full": full, "bare": _profiled(lambda: step(False))}


def test_an_fsdp_step_pays_one_small_all_reduce_besides_its_gathers() -> None:
    """--strategy fsdp --devices cpu,cpu: the collectives of a step with the NaN check and
    rt.should_stop, less those of the same step without them (fsdp's gathers and gradient
    reductions), is one agreement."""
    rt = paratrain.Runtime(strategy="fsdp", devices="cpu,cpu", seed=0)
    counted = rt.launch(_fsdp_run)
    assert counted is not None
    extra = counted["full"] - counted["bare"]
    assert extra == Counter({("gloo:all_reduce", AGREEMENT): STEPS}), counted
    assert not counted["bare"] - counted["full"], counted


PER_EPOCH = 24  # optimizer steps of an epoch of the paced runs


def _paced_run(rt: paratrain.Runtime) -> dict[str, Any]:
    """Epochs of rt.setup_loader's batches (the same number on every process); the third
    has a NaN loss on rank 1 at its sixth step."""
    model = _model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(0)
    samples = 16 * PER_EPOCH
    data = TensorDataset(
        torch.randn(samples, 6, generator=generator), torch.randn(samples, 1, generator=generator)
    )
    loader = rt.setup_loader(DataLoader(data, batch_size=16))

    def epoch(nan_at: int | None = None) -> None:
        for index, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if index == nan_at and rt.rank == 1:
                loss = loss * float("nan")
            rt.backward(loss)
            optimizer.step()
            rt.should_stop()

    epoch()  # the first agreements: the main process's pace is known after them
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        epoch()
    result: dict[str, Any] = {"collectives": Counter(_collectives(prof))}
    try:
        epoch(nan_at=5)  # the epoch's end reads its checks: the loop raises there
    except NonFiniteLossError as exc:
        result["error"] = str(exc)
    return result


def _paced_loop_left_early(rt: paratrain.Runtime, settle: bool = True) -> str:
    """A NaN at the fourth step, the loop left at the ninth: rt.settle (as rt.save does)
    agrees on the steps since the last agreement before anything is written; without it,
    the end of the launched function does."""
    model = _model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(16 * PER_EPOCH, 6, generator=generator),
        torch.randn(16 * PER_EPOCH, 1, generator=generator),
    )
    for index, (x, y) in enumerate(rt.setup_loader(DataLoader(data, batch_size=16))):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        rt.backward(loss * float("nan") if index == 3 and rt.rank == 1 else loss)
        optimizer.step()
        if index == 8:
            break
    if not settle:
        return "no error"
    try:
        rt.settle()
    except NonFiniteLossError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("seconds", [1000.0, 0.0])
def test_loader_batches_agree_at_the_main_process_pace(seconds: float) -> None:
    """--strategy ddp --devices cpu,cpu: on rt.setup_loader's batches the processes agree
    at the main process's pace (here: at each epoch's end, 1000 s being far away) and the
    NaN of a step between two agreements is still named with its rank and step;
    agreement_seconds=0 agrees at every step."""
    rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0, agreement_seconds=seconds)
    result = rt.launch(_paced_run)
    assert result is not None
    agreements = result["collectives"][("gloo:all_reduce", AGREEMENT)]
    assert agreements == (1 if seconds else PER_EPOCH), result["collectives"]
    assert "NaN or infinite on rank 1 at step " + str(2 * PER_EPOCH + 6) in result["error"]
    if seconds:
        flushed = rt.launch(_paced_loop_left_early)
        assert flushed is not None and "NaN or infinite on rank 1 at step 4;" in flushed, flushed
        with pytest.raises(LaunchError, match="NaN or infinite on rank 1 at step 4;"):
            rt.launch(_paced_loop_left_early, False)


_LEFT_EARLY_SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import paratrain

rt = paratrain.Runtime(strategy="ddp", devices="cpu,cpu", seed=0, agreement_seconds=1000)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = TensorDataset(torch.randn(16 * 24, 6), torch.randn(16 * 24, 1))
for index, (x, y) in enumerate(rt.setup_loader(DataLoader(data, batch_size=16))):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    rt.backward(loss * float("nan") if index == 3 and rt.rank == 1 else loss)
    optimizer.step()
    if index == 8:
        break
print("the loop ended", flush=True)
"""


def test_a_script_that_ends_without_settle_still_has_its_last_checks_read(tmp_path: Path) -> None:
    """Plain torchrun, two processes on the CPU (gloo): a script whose loop leaves an epoch
    early and ends without rt.settle or rt.save, at a pace far away, still has its last
    steps' checks read when it ends: exit 1, one line naming the rank and step of the NaN,
    no traceback from the processes (torchrun's agent prints its own on any failure)."""
    script = tmp_path / "left_early.py"
    script.write_text(_LEFT_EARLY_SCRIPT)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [sys.executable, *torchrun, str(script)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert done.stdout.count("the loop ended") == 2, done.stdout + done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("paratrain: error:")]
    assert len(said) == 1 and "NaN or infinite on rank 1 at step 4;" in said[0], done.stderr
    assert "NonFiniteLossError" not in done.stderr and "atexit" not in done.stderr, done.stderr
