"""`paratrain plan`: predicted peak memory per device for each layout, before renting."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from paratrain.cli.commands.bench_source import add_source_arguments, source_from_args
from paratrain.utils.errors import UserError

if TYPE_CHECKING:  # torch is imported where a plan is made, not for `paratrain plan --help`
    import torch
    from torch import nn

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="predict each device's peak memory per layout, without allocating it",
        description=(
            "Trace one training step on fake tensors (nothing is allocated) and predict, for "
            "each layout, every device's peak memory: parameters, gradients, optimizer state, "
            "activations and the rest; say which layouts fit and the largest batch of each."
        ),
    )
    add_source_arguments(p)
    p.add_argument("--batch-size", type=int, help="global batch; default: the recipe's (32)")
    p.add_argument("--precision", default="32", help="32, bf16 or fp16")
    p.add_argument("--devices", type=int, help="devices of the multi-device layouts (default 2)")
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="memory of each device, e.g. 80GiB (default: the GPUs here, else the host's)",
    )
    p.add_argument("--accelerator", choices=("cuda", "cpu"), help="default: cuda if present")
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="also plan with each block recomputing its activations: the memory it saves",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--chart", metavar="FILE.png", help="also draw the plan (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model and data (default 0)")
    p.set_defaults(handler=run)


def parse_size(text: str) -> int:
    """``80GiB``, ``80G``, ``512MiB``, ``1.5TB``, ``1000000`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", text)
    if match is None:
        raise UserError(f"--device-memory {text!r}: write a size such as 80GiB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def run(args: argparse.Namespace) -> int:
    import torch

    from paratrain.devices.precision import normalize_precision
    from paratrain.tools.plan import plan_memory
    from paratrain.tools.plan.chart import MISSING_MATPLOTLIB, write_plan_chart
    from paratrain.tools.plan.layouts import has_pairs, tp_row
    from paratrain.tools.plan.report import gib, print_plan

    source = source_from_args(args)
    precision = normalize_precision(args.precision)
    accelerator = args.accelerator or ("cuda" if torch.cuda.is_available() else "cpu")
    devices = args.devices if args.devices is not None else _device_count(accelerator)
    if devices < 1:
        raise UserError(f"--devices must be at least 1, got {devices}")
    memory, where = _memory(args.device_memory, accelerator)
    build, default_batch = task_builder(source)
    batch = args.batch_size if args.batch_size is not None else default_batch
    if batch < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch}")
    plans = {}
    for checkpointed in (False, True) if args.activation_checkpointing else (False,):
        wrap = with_checkpointing if checkpointed else None

        in_copies = has_pairs(devices)  # pipeline --replicate 2
        cuts = (devices, devices // 2) if in_copies else (devices,)
        traced = shared_traces(build, precision, wrap, cuts)
        tp_trace, tp_refused = tensor_parallel_tracer(build, devices, precision, wrap)
        plans[checkpointed] = plan_memory(
            traced[devices],
            source.name,
            batch,
            precision,
            devices,
            accelerator,
            memory,
            where,
            copy_trace=traced[devices // 2] if in_copies else None,
            tp_trace=tp_trace,
        )
        if tp_refused:
            plans[checkpointed].refused[tp_row(devices)] = tp_refused
    plan = plans[False]
    saved = {}
    if True in plans:
        for without, with_ in zip(plan.layouts, plans[True].layouts, strict=True):
            saved[without.layout] = {
                "peak": with_.peak,
                "saved": without.peak - with_.peak,
                "largest_batch": with_.largest_batch,
            }
    if args.json:
        payload = plan.as_dict()
        if saved:
            payload["activation_checkpointing"] = saved
        print(json.dumps(payload, indent=2))
    else:
        print_plan(plan)
        for layout, figures in saved.items():
            print(
                f"{layout}: with --activation-checkpointing the peak is {gib(figures['peak'])}"
                f" ({gib(figures['saved'])} less), largest batch {figures['largest_batch']}"
            )
    if args.chart and not write_plan_chart(plan, Path(args.chart)):
        print(MISSING_MATPLOTLIB)
    return 0


def shared_traces(
    build: Any, precision: str, wrap: Any, cuts: tuple[int, ...]
) -> dict[int, Callable[[int], Any]]:
    """A tracer for each pipeline cut in ``cuts`` (``{stages: tracer}``) that share their
    traced steps: a batch that two of them need is traced once."""
    from paratrain.tools.plan.trace import trace_cuts

    seen: dict[int, dict[int, Any]] = {}

    def at(batch: int) -> dict[int, Any]:
        if batch not in seen:
            seen[batch] = trace_cuts(build, batch, precision=precision, wrap=wrap, cuts=cuts)
        return seen[batch]

    def tracer(stages: int) -> Callable[[int], Any]:
        return lambda batch: at(batch)[stages]

    return {n: tracer(n) for n in cuts}


def tensor_parallel_tracer(
    build: Any, devices: int, precision: str, wrap: Any
) -> tuple[Callable[[int], Any] | None, str]:
    """fsdp x tp's tracer (a step of what one process of a pair holds) where its row is
    planned: the built-in GPT, whose widths split (else why not), on pairs of devices."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from paratrain.models.gpt import GPT
    from paratrain.strategies.tensor_parallel import check_tp_model, one_process_part
    from paratrain.tools.plan import trace_step
    from paratrain.tools.plan.layouts import has_pairs

    if not has_pairs(devices):
        return None, ""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build()[0]
    if not isinstance(model, GPT):  # --tp has no plan for it: no row
        return None, ""
    try:
        check_tp_model(model, 2, devices // 2)
    except UserError as refused:
        return None, str(refused)

    def cut(model: nn.Module) -> nn.Module:
        part = one_process_part(cast(GPT, model), 2)
        return wrap(part) if wrap is not None else part

    return lambda b: trace_step(build, b, precision=precision, wrap=cut), ""


def task_builder(source: Any) -> tuple[Any, int]:
    """What a traced step builds (under fake tensors) for a recipe or a script, and the
    default batch size."""
    from paratrain.tools.bench.task import import_factory

    if source.script is not None:
        factory = import_factory(source.script)

        def build_script() -> Any:
            built = factory()
            if not isinstance(built, tuple) or len(built) not in (3, 4):
                raise UserError(
                    f"--script {source.script}: the factory must return (model, loss_fn, "
                    "sample_batch) or (model, loss_fn, sample_batch, make_optimizer)"
                )
            make = built[3] if len(built) == 4 else _sgd
            return built[0], built[1], make, built[2]

        return build_script, 32
    return recipe_builder(source.recipe, source.data_dir, source.synthetic, source.seed)


def recipe_builder(
    name: str, data_dir: str | None = None, synthetic: int | None = None, seed: int = 0
) -> tuple[Any, int]:
    import torch

    from paratrain.training.config import TrainConfig
    from paratrain.training.recipes import get_recipe

    recipe = get_recipe(name)
    cfg = TrainConfig(
        recipe=name, strategy="cpu", seed=seed, data_dir=data_dir, synthetic=synthetic
    ).resolved(get_recipe)
    train_set, _ = recipe.build_data(cfg)  # real samples: a batch is made of copies of them
    first = [train_set[i] for i in range(min(len(train_set), 64))]  # type: ignore[arg-type]

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        picked = [first[i % len(first)] for i in range(n)]
        return (
            torch.stack([torch.as_tensor(x) for x, _ in picked]),
            torch.stack([torch.as_tensor(y) for _, y in picked]),
        )

    def build() -> Any:
        model = recipe.build_model(cfg)
        return model, recipe.build_loss(), lambda p: recipe.build_optimizer(p, cfg), sample

    return build, recipe.batch_size


def with_checkpointing(model: nn.Module) -> nn.Module:
    from paratrain.runtime.activation_checkpointing import apply_activation_checkpointing

    apply_activation_checkpointing(model)
    return model


def _sgd(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    import torch

    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _device_count(accelerator: str) -> int:
    import torch

    if accelerator == "cuda" and torch.cuda.is_available():
        return max(1, torch.cuda.device_count())
    return 2


def _memory(given: str | None, accelerator: str) -> tuple[int, str]:
    if given is not None:
        return parse_size(given), "--device-memory"
    import torch

    if accelerator == "cuda" and torch.cuda.is_available():
        sizes = [
            torch.cuda.get_device_properties(i).total_memory
            for i in range(torch.cuda.device_count())
        ]
        return min(sizes), "cuda:0" if len(sizes) == 1 else "the smallest GPU here"
    if accelerator == "cuda":
        raise UserError("no CUDA GPU here: give --device-memory (e.g. 80GiB) to plan for one")
    return _host_available(), "the host's available memory"


def _host_available() -> int:
    from paratrain.utils.peak_memory import available_host_bytes, total_host_bytes

    available = available_host_bytes()
    return available if available is not None else total_host_bytes()
