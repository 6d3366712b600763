"""`paratrain plan`: predicted peak memory per device, checked against the same tracker
over real tensors (--strategy cpu: one process, the layout's per-device batch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import paratrain
from paratrain.cli.commands.plan import parse_size, recipe_builder, tensor_parallel_tracer
from paratrain.cli.main import main
from paratrain.models import GPT
from paratrain.tools.plan import plan_memory, trace_step
from paratrain.tools.plan.layouts import layouts, per_device
from paratrain.tools.plan.trace import Breakdown, StepTrace, totals_tracker


def _gpt(width: int) -> Any:
    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 64, (n, 33), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

    def build() -> Any:
        model = GPT(width=width, depth=2)
        return model, loss, lambda p: torch.optim.AdamW(p, lr=1e-3), sample

    return build


#: Hugging Face configs (``--recipe hf:CONFIG``): GPT-2 (head tied) and Llama (grouped heads)
_HF_CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4, "n_positions": 64,
             "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 0},
    "llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 0,
              "eos_token_id": 0},
}  # fmt: skip


def _hugging_face(family: str, folder: Path) -> Any:
    path = folder / f"{family}.json"
    path.write_text(json.dumps(_HF_CONFIGS[family]))
    return recipe_builder(f"hf:{path}")[0]


def _builders(folder: Path) -> dict[str, tuple[Any, int]]:
    """The models by name, and a batch size; ``folder`` holds the Hugging Face configs."""
    return {
        "digits": (recipe_builder("digits")[0], 64),
        "cifar10-resnet18": (recipe_builder("cifar10-resnet18", synthetic=16)[0], 4),
        "tiny-gpt width 64": (_gpt(64), 8),
        "tiny-gpt width 256": (_gpt(256), 8),
        "hf:gpt2": (_hugging_face("gpt2", folder), 8),
        "hf:llama": (_hugging_face("llama", folder), 8),
    }


@pytest.mark.slow
def test_prediction_within_15_percent_of_the_measured_peak(tmp_path: Path) -> None:
    """--strategy cpu: for each model, the peak predicted on fake tensors is within 15% of
    the peak the same tracker measures over real tensors."""
    errors = {}
    for name, (build, batch) in _builders(tmp_path).items():
        for size in (batch,):
            predicted = trace_step(build, size).peak
            measured = trace_step(build, size, fake=False).peak
            errors[f"{name} @{size}"] = predicted.total / measured.total - 1
            assert measured.parameters > 0 and measured.activations > 0
    assert all(abs(error) <= 0.15 for error in errors.values()), errors


@pytest.mark.slow
def test_layouts_split_what_they_split(tmp_path: Path) -> None:
    """--strategy cpu tracing: ddp halves activations, fsdp shards the optimizer state,
    pipeline's first stage holds more activations than its last; a tiny device fits none."""
    build, _ = _builders(tmp_path)["tiny-gpt width 64"]
    plan = plan_memory(lambda b: trace_step(build, b), "gpt", 16, "32", 2, "cuda", 1 << 30, "test")
    by = {p.layout: p for p in plan.layouts}
    assert set(by) == {"cuda", "dp", "dp-balanced", "ddp", "fsdp", "pipeline"}
    one, ddp, fsdp, pipe = by["cuda"], by["ddp"], by["fsdp"], by["pipeline"]
    assert ddp.devices[0].activations < 0.6 * one.devices[0].activations
    assert fsdp.devices[0].optimizer < 0.6 * one.devices[0].optimizer
    assert pipe.devices[0].activations > pipe.devices[1].activations
    assert by["dp"].devices[1].optimizer == 0 and by["dp"].devices[0].optimizer > 0
    assert all(p.fits and p.largest_batch >= 16 for p in plan.layouts)
    small = plan_memory(
        lambda b: trace_step(build, b), "gpt", 16, "32", 2, "cuda", one.peak // 2, "test"
    )
    assert not {p.layout: p for p in small.layouts}["cuda"].fits


@pytest.mark.slow
def test_pipeline_stages_hold_their_own_layers_and_all_their_gradients(tmp_path: Path) -> None:
    """--strategy cpu tracing, pipeline x2: digits is cut into its convolutions (small) and
    its classifier (most of the parameters); each stage keeps all its gradients."""
    build, batch = _builders(tmp_path)["digits"]
    plan = plan_memory(
        lambda b: trace_step(build, b, stages=2), "digits", batch, "32", 2, "cpu", 1 << 40, "-"
    )
    first, last = next(p for p in plan.layouts if p.layout == "pipeline").devices
    assert 6 * first.parameters < last.parameters
    whole = trace_step(build, batch).parameter_bytes
    assert abs(first.parameters + last.parameters - whole) <= 2  # rounding of each share
    assert first.gradients == first.parameters and last.gradients == last.parameters


@pytest.mark.slow
def test_pipeline_activations_sit_in_the_stage_whose_layers_make_them() -> None:
    """--strategy cpu tracing, pipeline x2: a wide block (large activations) and a narrow
    one, in both orders; the stage holding the wide block holds most of the activations
    (an even split would give the first stage twice the last's, in either order)."""

    def wide() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 512), nn.ReLU(), nn.Linear(512, 2))

    def narrow() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 8), nn.Linear(8, 2))

    def builder(first_wide: bool) -> Any:
        def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(n, 2), torch.randn(n, 2)

        def build() -> Any:
            blocks = (wide(), narrow()) if first_wide else (narrow(), wide())
            model = nn.Sequential(*blocks)
            return model, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.1), sample

        return build

    for first_wide in (True, False):
        build = builder(first_wide)
        plan = plan_memory(
            lambda b, build=build: trace_step(build, b, stages=2),
            "wide-narrow",
            64,
            "32",
            2,
            "cpu",
            1 << 40,
            "-",
        )
        first, last = next(p for p in plan.layouts if p.layout == "pipeline").devices
        if first_wide:
            assert first.activations > 8 * last.activations
        else:
            assert last.activations > 2 * first.activations


@pytest.mark.slow
def test_a_pipeline_in_two_copies_is_two_pipelines_of_half_the_stages_on_half_the_batch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--strategy cpu tracing, 4 devices: the ``pipeline 2x2`` row (pipeline --replicate 2)
    holds, on each copy, what a 2-stage pipeline holds at half the batch (a model of 2 blocks,
    which one pipeline of 4 stages cannot cut); `paratrain plan --devices 4` lists it beside
    ``hsdp 2x2`` and ``fsdp x tp 2x2``, and not on 3 devices."""
    build, _ = _builders(tmp_path)["tiny-gpt width 64"]
    traced: dict[tuple[int, int], Any] = {}  # a 2-stage cut at one batch, traced once

    def cut(stages: int) -> Any:
        def trace(b: int) -> Any:
            if (stages, b) not in traced:
                traced[stages, b] = trace_step(build, b, stages=stages)
            return traced[stages, b]

        return trace

    four = plan_memory(cut(4), "gpt", 16, "32", 4, "cpu", 1 << 40, "-", copy_trace=cut(2))
    two = plan_memory(cut(2), "gpt", 8, "32", 2, "cpu", 1 << 40, "-")
    copies = next(p for p in four.layouts if p.layout == "pipeline 2x2")
    pipeline = next(p for p in two.layouts if p.layout == "pipeline")
    assert copies.devices == pipeline.devices * 2
    # its 2 blocks cannot be cut into 4 stages: one pipeline over the 4 devices is refused
    assert "needs at least 4 layers" in four.refused["pipeline"]
    args = ["plan", "--recipe", "tiny-gpt", "--batch-size", "8", "--accelerator", "cpu"]
    assert main([*args, "--devices", "4", "--json"]) == 0
    named = [p["layout"] for p in json.loads(capsys.readouterr().out)["layouts"]]
    assert named[-3:] == ["fsdp x tp 2x2", "hsdp 2x2", "pipeline 2x2"]
    three = layouts(3, "cpu", pipeline_copies=True)
    assert not any(layout.name.startswith("pipeline 2x") for layout in three)


def test_hsdp_shards_over_one_copy_only() -> None:
    """On 4 devices hsdp 2x2 (fsdp --replicate 2) holds each process's shard of 1/2 of the
    parameters, gradients and optimizer state (fsdp x4: 1/4) and the same activations (a 1/4
    part of the batch); 3 devices make no two equal copies. (Against FSDPMemTracker in 4 real
    processes: test_hsdp_prediction_within_15_percent_of_four_real_processes.)"""
    chosen = {layout.name: layout for layout in layouts(4, "cpu")}
    assert chosen["hsdp 2x2"].replicate == 2 and chosen["hsdp 2x2"].per_device(16) == 4
    assert not any(name.startswith("hsdp") for name in (x.name for x in layouts(3, "cpu")))
    peak = Breakdown(parameters=800, gradients=800, optimizer=1600, activations=400, other=40)
    trace = StepTrace(4, peak, 0, parameter_bytes=800, largest_block_bytes=100)
    fsdp = per_device(chosen["fsdp"], trace, trace)
    hsdp = per_device(chosen["hsdp 2x2"], trace, trace)
    assert len(hsdp) == 4 and len(set(hsdp)) == 1
    # sharded over 2: 400 parameters, + the two largest blocks gathered beyond the own shard
    assert hsdp[0] == Breakdown(400, 400 + 100, 800, 400, 40)
    assert fsdp[0] == Breakdown(200 + 0, 200 + 100, 400, 400, 40)


@pytest.mark.slow
def test_plan_command_json_and_bad_size(capsys: pytest.CaptureFixture[str]) -> None:
    """`paratrain plan --accelerator cpu` (cpu, cpu,cpu): JSON with every kind of memory per
    device and the memory activation checkpointing saves; a size it cannot read is one line
    and exit code 2."""
    args = ["plan", "--recipe", "tiny-gpt", "--batch-size", "8", "--accelerator", "cpu", "--json"]
    assert main([*args, "--devices", "1", "--activation-checkpointing"]) == 0
    saved = json.loads(capsys.readouterr().out)["activation_checkpointing"]
    assert saved["cpu"]["saved"] > 0
    assert main(["plan", "--recipe", "digits", "--accelerator", "cpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [p["layout"] for p in plan["layouts"]] == ["cpu", "ddp", "fsdp", "pipeline"]
    first = plan["layouts"][0]["devices"][0]
    assert first["parameters"] > 0 and first["total"] == sum(
        first[k] for k in ("parameters", "gradients", "optimizer", "activations", "other")
    )
    assert main(["plan", "--device-memory", "lots"]) == 2
    assert "--device-memory 'lots': write a size such as 80GiB" in capsys.readouterr().err
    assert parse_size("80GiB") == 80 << 30 and parse_size("512M") == 512 << 20


def _measure_fsdp(rt: paratrain.Runtime, batch: int, width: int = 64) -> list[int]:
    """In each fsdp process: the peak FSDPMemTracker sees over two real steps of tiny-gpt
    (width 64), on this process's part of the batch (a tp group's processes share one)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    peaks = []
    for build in (_gpt(width),):
        model, loss_fn, make_optimizer, sample = build()
        optimizer = make_optimizer(model.parameters())
        model, optimizer = rt.setup(model, optimizer)
        x, y = sample(batch // rt.strategy.data_shards)
        tracker = FSDPMemTracker(model, optimizer)
        with tracker:
            for _ in range(2):
                loss_fn(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                tracker.reset_mod_stats()
        peaks.append(max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values()))
    return peaks


@pytest.mark.slow
def test_fsdp_prediction_within_15_percent_of_two_real_processes() -> None:
    """--strategy fsdp on cpu,cpu: the predicted per-process peak of tiny-gpt is within 15%
    of what FSDP2's memory tracker measures in two real gloo processes (all four models and
    ddp: benchmarks/plan_accuracy.py)."""
    measured = paratrain.Runtime("fsdp", devices="cpu,cpu").launch(_measure_fsdp, 16)
    assert measured is not None
    for build, peak in zip((_gpt(64),), measured, strict=True):
        plan = plan_memory(lambda b, f=build: trace_step(f, b), "m", 16, "32", 2, "cpu", 1, "-")
        predicted = {p.layout: p.peak for p in plan.layouts}["fsdp"]
        assert abs(predicted / peak - 1) <= 0.15, (predicted, peak)


@pytest.mark.slow
def test_hsdp_prediction_within_15_percent_of_four_real_processes() -> None:
    """--strategy fsdp --replicate 2 on 4 cpu processes (2 copies, each sharded over 2):
    the predicted per-process peak of the ``hsdp 2x2`` row is within 15% of what FSDP2's
    memory tracker measures, for a GPT whose weights and AdamW state outweigh its
    activations (sharding them over 4 instead of 2 would be off by far more)."""
    rt = paratrain.Runtime("fsdp", devices="cpu,cpu,cpu,cpu", replicate=2)
    measured = rt.launch(_measure_fsdp, 8, 256)
    assert measured is not None
    build = _gpt(256)
    plan = plan_memory(lambda b: trace_step(build, b), "m", 8, "32", 4, "cpu", 1, "-")
    predicted = {p.layout: p.peak for p in plan.layouts}["hsdp 2x2"]
    print(f"\nhsdp 2x2: predicted {predicted}, measured {measured[0]} bytes")
    assert abs(predicted / measured[0] - 1) <= 0.15, (predicted, measured)


@pytest.mark.slow
def test_fsdp_x_tp_prediction_within_15_percent_of_four_real_processes() -> None:
    """--strategy fsdp --tp 2 on 4 cpu processes (a 2 x 2 mesh): the predicted per-process
    peak of tiny-gpt's ``fsdp x tp 2x2`` row, traced from what one process of a pair holds,
    is within 15% of what FSDP2's memory tracker measures; the row is the built-in GPT's
    only, and one whose heads do not split in two is refused, saying why."""
    rt = paratrain.Runtime("fsdp", devices="cpu,cpu,cpu,cpu", tp=2)
    measured = rt.launch(_measure_fsdp, 16)
    assert measured is not None
    build = _gpt(64)
    tracer = tensor_parallel_tracer(build, 4, "32", None)[0]
    assert tracer is not None
    plan = plan_memory(
        lambda b: trace_step(build, b), "m", 16, "32", 4, "cpu", 1, "-", None, tracer
    )
    by = {p.layout: p.peak for p in plan.layouts}
    print(f"\nfsdp x tp 2x2: predicted {by['fsdp x tp 2x2']}, measured {measured[0]} bytes")
    assert abs(by["fsdp x tp 2x2"] / measured[0] - 1) <= 0.15, (by, measured)
    assert tensor_parallel_tracer(recipe_builder("digits")[0], 4, "32", None) == (None, "")
    odd_heads = tensor_parallel_tracer(_gpt_with_heads(3), 4, "32", None)
    assert (
        odd_heads[0] is None
        and "--tp 2 does not divide the GPT's 3 attention heads" in odd_heads[1]
    )


def _measure_pipeline(rt: paratrain.Runtime, batch: int) -> list[int]:
    """In each pipeline process: the peak torch's MemTracker sees over two real steps of
    tiny-gpt (width 64) on this copy's part of the batch, every process's peak."""
    model, loss_fn, make_optimizer, sample = _gpt(64)()
    optimizer = make_optimizer(model.parameters())
    model, optimizer = rt.setup(model, optimizer)
    x, y = sample(batch // rt.strategy.data_shards)  # every stage of a copy: its part
    tracker = totals_tracker(model, optimizer)
    with tracker:
        for _ in range(2):
            rt.forward_backward(model, loss_fn, x, y)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()
    # the other stages' parameters are placeholders on the meta device
    snapshot = tracker.get_tracker_snapshot("peak")
    peak = max(d["Total"] for device, d in snapshot.items() if str(device) != "meta")
    peaks = torch.zeros(rt.world_size, dtype=torch.float64)
    peaks[rt.rank] = float(peak)
    return [int(v) for v in rt.all_reduce(peaks, "sum", over="processes").tolist()]


@pytest.mark.slow
def test_pipeline_copies_prediction_within_15_percent_of_four_real_processes() -> None:
    """--strategy pipeline --replicate 2 on 4 cpu processes (2 copies of a 2-stage
    pipeline): the predicted peak of each process of tiny-gpt's ``pipeline 2x2`` row (the
    row `paratrain plan --devices 4` prints) is within 15% of what torch's MemTracker
    measures in that process."""
    rt = paratrain.Runtime("pipeline", devices="cpu,cpu,cpu,cpu", replicate=2)
    measured = rt.launch(_measure_pipeline, 16)
    assert measured is not None and all(peak > 0 for peak in measured)
    build = _gpt(64)

    def cut(stages: int) -> Any:
        return lambda b: trace_step(build, b, stages=stages)

    plan = plan_memory(cut(4), "m", 16, "32", 4, "cpu", 1, "-", copy_trace=cut(2))
    predicted = [
        d.total for d in next(p for p in plan.layouts if p.layout == "pipeline 2x2").devices
    ]
    print(f"\npipeline 2x2: predicted {predicted}, measured {measured} bytes")
    errors = [p / m - 1 for p, m in zip(predicted, measured, strict=True)]
    assert all(abs(error) <= 0.15 for error in errors), (predicted, measured)


def _gpt_with_heads(heads: int) -> Any:
    build = _gpt(48)

    def with_heads() -> Any:
        _, *rest = build()
        return (GPT(width=48, depth=2, heads=heads), *rest)

    return with_heads


_OUTPUT_SCRIPT = """
import dataclasses
import torch
from torch import nn


@dataclasses.dataclass
class Output:  # what a Hugging Face model returns: a dataclass (and a dict)
    loss: torch.Tensor | None
    logits: torch.Tensor


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return Output(None, self.head(torch.relu(self.body(x))))


def build():
    def loss_fn(out, y):
        return nn.functional.cross_entropy(out.logits, y)

    def sample(n):
        return torch.randn(n, 16), torch.randint(0, 4, (n,))

    return Model(), loss_fn, sample
"""


def test_plan_of_a_model_returning_a_dataclass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`paratrain plan --script` on a model whose output is a dataclass (a ``ModelOutput``):
    its logits are counted as the output, not a traceback."""
    script = tmp_path / "model.py"
    script.write_text(_OUTPUT_SCRIPT)
    args = ["plan", "--script", f"{script}:build", "--batch-size", "8", "--accelerator", "cpu"]
    assert main([*args, "--json"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert plan["layouts"][0]["layout"] == "cpu"
    assert plan["layouts"][0]["devices"][0]["total"] > 0
