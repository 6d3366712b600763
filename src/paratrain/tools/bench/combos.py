"""Which (strategy, precision, batch size) combinations to measure, and why others cannot run.

Everything comes from the strategy registry: a strategy added later appears here without a
change. A combination this machine cannot run is kept, with the reason, so the report says
what was left out instead of silently measuring less.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from paratrain.devices.machine import cuda_count, mps_available
from paratrain.devices.precision import normalize_precision, precision_unavailable_reason
from paratrain.strategies import AUTO, build_strategy, resolve_auto, strategy_class, strategy_names
from paratrain.strategies.base import Strategy, StrategyOptions
from paratrain.strategies.choices import CHOICES
from paratrain.strategies.single import SingleDeviceStrategy
from paratrain.utils.errors import UserError

#: the name of a layout in copies (``--replicate``) where it has one of its own
IN_COPIES = {"fsdp": "hsdp"}


@dataclass(frozen=True)
class Combo:
    """One measured layout. ``devices`` is the spec handed to the strategy (None: its own)."""

    strategy: str
    precision: str
    batch_size: int
    devices: str | None
    device_names: tuple[str, ...] = ()
    processes: int = 1
    skip_reason: str | None = None
    #: each block recomputes its activations in the backward (bench --activation-checkpointing)
    activation_checkpointing: bool = False
    #: intra-op threads of each process where not the count paratrain chooses (bench --threads)
    threads: int | None = None
    #: copies of the layout (``--replicate``) and processes splitting each layer (``--tp``):
    #: the two-dimensional layouts
    replicate: int = 1
    tp: int = 1

    @property
    def layout(self) -> str:
        """The layout: ``ddpx2``, and the two-dimensional ones as `paratrain plan` names
        their rows (``hsdp 2x2``, ``fsdp x tp 2x2``, ``pipeline 2x2``)."""
        n = len(self.device_names)
        if self.replicate * self.tp == 1:
            return self.strategy + (f"x{n}" if n > 1 else "")
        n = max(n, self.processes)  # a row skipped for every setting lists no devices
        if self.tp > 1:
            return f"{self.strategy} x tp {n // self.tp}x{self.tp}"
        name = IN_COPIES.get(self.strategy, self.strategy)
        return f"{name} {self.replicate}x{n // self.replicate}"

    @property
    def label(self) -> str:
        if self.precision == "-":  # a row for every setting: the layout alone
            return self.strategy if self.replicate * self.tp == 1 else self.layout
        layout = self.layout
        recompute = " ac" if self.activation_checkpointing else ""
        threads = f" t{self.threads}" if self.threads is not None else ""
        return f"{layout} {self.precision} b{self.batch_size}{recompute}{threads}"

    @property
    def on_cpu(self) -> bool:
        """Whether every device is a CPU: its intra-op threads set its speed."""
        return bool(self.device_names) and all(d == "cpu" for d in self.device_names)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["device_names"] = list(self.device_names)
        data["label"] = self.label
        return data


def default_devices() -> str:
    """What the multi-device strategies get when ``--devices`` is not given: every CUDA GPU,
    else two CPU workers (gloo), which every machine can run."""
    count = cuda_count()
    return str(count) if count > 0 else "cpu,cpu"


def default_precisions(device_type: str) -> list[str]:
    """The precisions worth measuring on a device type: those it computes natively."""
    if device_type == "cuda":
        return ["32", "bf16", "fp16"] if torch.cuda.is_bf16_supported() else ["32", "fp16"]
    if device_type == "mps":
        return ["32", "fp16"]
    return ["32", "bf16"] if _cpu_has_native_bf16() else ["32"]


def _cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def parse_strategy_list(text: str | None) -> list[str] | None:
    """``a,b`` into registered names (``auto`` resolved here), or None for the default set."""
    if text is None:
        return None
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            raise UserError(f"--strategies {text!r} has an empty entry; write e.g. cpu,ddp")
        if name == AUTO:
            name = resolve_auto(None)
        strategy_class(name)  # unknown names fail here, listing the valid ones
        if name not in names:
            names.append(name)
    return names


def parse_precision_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    result: list[str] = []
    for raw in text.split(","):
        name = normalize_precision(raw.strip())
        if name not in result:
            result.append(name)
    return result


def parse_batch_sizes(text: str | None) -> list[int] | None:
    return _positive_counts("--batch-sizes", text)


def _positive_counts(flag: str, text: str | None) -> list[int] | None:
    """``flag``'s comma list of positive integers, each once, in order; None when not given."""
    if text is None:
        return None
    counts: list[int] = []
    for raw in text.split(","):
        try:
            count = int(raw.strip())
        except ValueError:
            raise UserError(f"{flag} {text!r}: {raw.strip()!r} is not a number") from None
        if count < 1:
            raise UserError(f"{flag} entries must be at least 1, got {count}")
        if count not in counts:
            counts.append(count)
    return counts


def _build(
    name: str, devices: str, options: StrategyOptions | None = None
) -> tuple[Strategy | None, str | None, str | None]:
    """Build ``name`` for ``devices``: (strategy, the spec used, why it cannot run)."""
    cls = strategy_class(name)
    reason = cls.unavailable_reason()
    if reason is not None:
        return None, None, reason
    try:
        return build_strategy(name, devices, options), devices, None
    except UserError as exc:
        if not issubclass(cls, SingleDeviceStrategy):
            return None, None, str(exc)
    # A one-device strategy is measured on its own device, whatever --devices lists.
    try:
        return build_strategy(name, None), None, None
    except UserError as exc:
        return None, None, str(exc)


def enumerate_combos(
    strategies: Sequence[str] | None,
    precisions: Sequence[str] | None,
    batch_sizes: Sequence[int],
    devices: str | None,
) -> list[Combo]:
    """Every combination, in a stable order; the ones that cannot run carry a skip reason.

    ``strategies=None`` means every registered strategy that can run here, except layouts
    that only make sense as tests (see :func:`not_by_default`). ``precisions=None`` means
    the ones native to each strategy's device.
    """
    spec = devices if devices is not None else default_devices()
    explicit = strategies is not None
    names = list(strategies) if strategies is not None else strategy_names(include_auto=False)
    gpus, mps = cuda_count(), mps_available()
    combos: list[Combo] = []
    for name in names:
        strategy, used_spec, reason = _build(name, spec)
        if strategy is None:
            # One row per strategy that cannot run here: its reason holds for every setting.
            combos.append(Combo(name, "-", batch_sizes[0], spec, skip_reason=reason))
            continue
        flat = strategy
        for replicate, tp in [(1, 1), *mesh_shapes(name, flat.num_processes)]:
            base = Combo(name, "-", batch_sizes[0], used_spec, replicate=replicate, tp=tp)
            base = replace(base, processes=flat.num_processes)
            if (replicate, tp) != (1, 1):
                options = StrategyOptions(replicate=replicate, tp=tp)
                built, _, reason = _build(name, spec, options)
                if built is None:  # a mesh these processes do not make
                    combos.append(replace(base, skip_reason=reason))
                    continue
                strategy = built
            combos += _settings(base, strategy, explicit, precisions, batch_sizes, gpus, mps)
    return combos


def mesh_shapes(name: str, processes: int) -> list[tuple[int, int]]:
    """The two-dimensional layouts of strategy ``name`` measured on ``processes`` processes
    (4 or more, even), as (replicate, tp): two copies where it runs in copies (hsdp,
    pipeline), pairs splitting each layer where it splits them (fsdp x tp)."""
    choice = CHOICES.get(name)
    if choice is None or processes < 4 or processes % 2:
        return []
    shapes = [(2, 1)] if choice.replicates else []
    return shapes + ([(1, 2)] if choice.splits_layers else [])


def _settings(
    base: Combo,
    strategy: Strategy,
    explicit: bool,
    precisions: Sequence[str] | None,
    batch_sizes: Sequence[int],
    gpus: int,
    mps: bool,
) -> list[Combo]:
    """``base``'s layout at every precision and batch size (one skipped row where the
    default set leaves the layout out)."""
    reason = None
    if not explicit:
        reason = not_by_default(base.strategy, strategy.devices, strategy.num_processes, gpus, mps)
    if reason is not None:
        return [replace(base, skip_reason=reason)]
    device_names = tuple(str(d) for d in strategy.devices)
    root = strategy.root_device
    chosen = list(precisions) if precisions is not None else default_precisions(root.type)
    found = []
    for precision in chosen:
        precision_reason = _precision_reason(precision, strategy)
        for batch in batch_sizes:
            why = precision_reason
            if why is None and batch < len(device_names):
                why = f"batch size {batch} is smaller than the {len(device_names)} devices"
            found.append(
                replace(
                    base,
                    precision=precision,
                    batch_size=batch,
                    device_names=device_names,
                    processes=strategy.num_processes,
                    skip_reason=why,
                )
            )
    return found


def refuse_models(combos: Sequence[Combo], model: nn.Module) -> list[Combo]:
    """Each combination whose layout refuses ``model`` (a GPT's plan for ``--tp``, a
    pipeline's cut, ...) skipped with the layout's own reason, before any worker starts."""
    result: list[Combo] = []
    refusals: dict[tuple[str, str | None, int, int], str | None] = {}
    for combo in combos:
        if combo.skip_reason is None and strategy_class(combo.strategy).checks_model:
            key = (combo.strategy, combo.devices, combo.replicate, combo.tp)
            if key not in refusals:
                refusals[key] = _refusal(combo, model)
            if refusals[key] is not None:
                combo = replace(combo, skip_reason=refusals[key])
        result.append(combo)
    return result


def _refusal(combo: Combo, model: nn.Module) -> str | None:
    options = StrategyOptions(replicate=combo.replicate, tp=combo.tp)
    try:
        build_strategy(combo.strategy, combo.devices, options).check_model(model)
    except UserError as refused:
        return str(refused)
    return None


def with_activation_checkpointing(combos: Sequence[Combo]) -> list[Combo]:
    """Each measurable combination followed by the same with activation checkpointing,
    where its strategy allows it: the time recomputing costs, the memory it saves."""
    result: list[Combo] = []
    for combo in combos:
        result.append(combo)
        if (
            combo.skip_reason is None
            and strategy_class(combo.strategy).allows_activation_checkpointing
        ):
            result.append(replace(combo, activation_checkpointing=True))
    return result


def parse_thread_counts(text: str | None) -> list[int] | None:
    """``--threads 1,2`` into counts, or None for the default (see :func:`with_thread_counts`)."""
    return _positive_counts("--threads", text)


def with_thread_counts(
    combos: Sequence[Combo], counts: Sequence[int] | None, chosen: Callable[[int], int]
) -> list[Combo]:
    """Each measurable CPU combination once per intra-op thread count of ``counts`` (per
    process, labelled ``tN``).

    ``counts=None``: the count paratrain chooses (``chosen(processes)``, unlabelled), and one
    thread as well (``t1``) for a single process that would get several: the two settings a
    CPU user picks between (one thread is slower on a quiet machine, the fastest beside
    other work). Layouts compare at equal total threads: cores / processes each.
    Combinations on GPUs run as they are: their threads only feed the device.
    """
    result: list[Combo] = []
    for combo in combos:
        if combo.skip_reason is not None or not combo.on_cpu:
            result.append(combo)
            continue
        if counts is not None:  # asked for: each labelled with its count
            result.extend(replace(combo, threads=count) for count in counts)
            continue
        result.append(combo)
        if combo.processes == 1 and chosen(combo.processes) > 1:
            result.append(replace(combo, threads=1))
    return result


def not_by_default(
    name: str,
    devices: Sequence[torch.device],
    processes: int,
    cuda_devices: int,
    mps: bool = False,
) -> str | None:
    """Why the default set leaves out strategy ``name`` on ``devices`` (run by ``processes``
    processes) on a machine with ``cuda_devices`` CUDA GPUs (and MPS or not); None: measure it.

    Left out: CPU layouts on a machine with a GPU; a layout for several devices (dp,
    dp-balanced, ddp) on a machine with one CUDA GPU, where it runs on that GPU alone (the
    cuda layout plus its own overhead); one process driving the same device twice (threads
    sharing one CPU); fsdp and pipeline on CPU processes (:data:`MEMORY_LAYOUTS`). Each
    stays measurable by naming it in ``--strategies``.
    """
    hint = "name it in --strategies to measure it"
    if (cuda_devices > 0 or mps) and devices[0].type == "cpu":
        return f"a CPU layout on a machine with a GPU; {hint}"
    several = not issubclass(strategy_class(name), SingleDeviceStrategy)
    if several and cuda_devices == 1 and devices[0].type == "cuda":
        return (
            "a layout for several GPUs on a machine with one, not a speed-up over cuda; "
            "name it in --strategies to measure its code path (dp and dp-balanced with "
            "--devices cuda:0,cuda:0 run two replicas on it)"
        )
    if processes == 1 and len(set(devices)) < len(devices):
        return f"one process repeating a device is a test layout, not a speed-up; {hint}"
    if name in MEMORY_LAYOUTS and devices[0].type == "cpu":
        return (
            f"on CPU processes {MEMORY_LAYOUTS[name]}: it cannot be faster than ddp on the "
            f"same processes, it saves memory; {hint}"
        )
    return None


#: layouts that trade speed for memory: the same work as ddp, more communication or idle
#: stages. Where the CPU's processes share one machine's memory they cannot win (cut from
#: the default set to keep it short); on GPUs they stay, memory is what they are for.
MEMORY_LAYOUTS = {
    "fsdp": "fsdp gathers every layer's parameters in each forward and backward",
    "pipeline": "pipeline stages wait for each other (the bubble)",
}


def _precision_reason(precision: str, strategy: Strategy) -> str | None:
    refused = strategy.precision_refused(precision)
    if refused is not None:
        return refused
    for device in strategy.devices:
        reason = precision_unavailable_reason(precision, device)
        if reason is not None:
            return reason
    return None
