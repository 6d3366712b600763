"""What a :class:`~paratrain.Runtime` is built from: everything needed to rebuild the same
runtime in another process (``paratrain.Runtime.from_config``).

Each option is declared once, here: its name, type, default, help text, how it is checked
and its flag on `paratrain train` (:func:`option`). ``Runtime(...)``'s keywords, its
docstring's list of options, `paratrain train`'s flags (tests/test_config_agreement.py)
and the checks before any process starts all come from these declarations. Options that
only one strategy reads live on the strategy's choice
(:mod:`paratrain.strategies.choices`); the flat keywords of before (``fsdp_blocks=``, ...)
map onto it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paratrain.launching.watchdog import TIMEOUT_VARIABLE
from paratrain.runtime.batching import check_batch_size_per
from paratrain.utils import environment
from paratrain.utils.errors import UserError

if TYPE_CHECKING:  # `paratrain train --help` reads the declarations without importing torch
    from paratrain.runtime.speed import SpeedOptions
    from paratrain.strategies import StrategyChoice, StrategyOptions

AUTO = "auto"
#: defaults for ``strategy="auto"`` and ``devices=None``, set by `paratrain run`
STRATEGY_VARIABLE = "PARATRAIN_STRATEGY"
DEVICES_VARIABLE = "PARATRAIN_DEVICES"
#: the non-finite policy where none is given (documented in docs/reference/environment.md)
NONFINITE_VARIABLE = "PARATRAIN_NONFINITE"
NONFINITE_POLICIES = ("error", "skip", "off")


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    check: Callable[[Any], Any] | None = None,
    factory: Callable[[], Any] | None = None,
    cli: dict[str, Any] | None = None,
) -> Any:
    """Declare one option of the runtime: ``help`` is its documentation, ``flag`` its
    option on `paratrain train` (None: none), ``check`` returns the value normalized or
    raises ``UserError``; ``cli``: the flag's argparse keywords, where `paratrain train`
    (and `tune`) generate it from this declaration (:func:`command_line_options`)."""
    metadata = {"help": help, "flag": flag, "check": check, "cli": cli}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _strategy(value: str | StrategyChoice) -> StrategyChoice:
    from paratrain.strategies import choose, strategy_names

    choice = choose(value) if isinstance(value, str) else value
    if choice.name not in strategy_names():
        valid = ", ".join(strategy_names())
        raise UserError(f"unknown strategy {choice.name!r}; valid strategies: {valid}")
    return choice


def _auto() -> StrategyChoice:
    from paratrain.strategies import Auto

    return Auto()


def _speed() -> SpeedOptions:
    from paratrain.runtime.speed import SpeedOptions

    return SpeedOptions()


def _precision(name: str) -> str:
    from paratrain.devices.precision import normalize_precision

    return normalize_precision(name)


def _oom(mode: str) -> str:
    from paratrain.runtime.oom import check_oom_mode

    return check_oom_mode(mode)


def _devices(value: str | int | None) -> str | None:
    return None if value is None else str(value)


def _at_least_one(flag: str) -> Callable[[int | None], int | None]:
    def check(value: int | None) -> int | None:
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
        return value

    return check


def _nonfinite(policy: str) -> str:
    if policy not in NONFINITE_POLICIES:
        raise UserError(f"non-finite policy {policy!r}: use one of {', '.join(NONFINITE_POLICIES)}")
    return policy


def nonfinite_from_env() -> str:
    """``PARATRAIN_NONFINITE``, read once, when a configuration is built (default error)."""
    policy = environment.current().get(NONFINITE_VARIABLE) or "error"
    if policy not in NONFINITE_POLICIES:
        raise UserError(
            f"{NONFINITE_VARIABLE}={policy!r}: use one of {', '.join(NONFINITE_POLICIES)}"
        )
    return policy


def _non_negative_seconds(seconds: float) -> float:
    if not (isinstance(seconds, (int, float)) and seconds >= 0 and math.isfinite(seconds)):
        raise UserError(f"agreement_seconds={seconds!r} must be a number of seconds, 0 or more")
    return float(seconds)


def check_hang_timeout(seconds: float | None) -> float | None:
    """``seconds`` if it is a hang timeout (0: off; None: the default), else ``UserError``."""
    if seconds is not None and not (seconds >= 0 and math.isfinite(seconds)):
        raise UserError(
            f"{TIMEOUT_VARIABLE}={str(seconds)!r} (--hang-timeout) must be a number of "
            "seconds, 0 for off"
        )
    return seconds


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything needed to rebuild the same runtime in another process, checked when it is
    built (before any process starts)."""

    strategy: StrategyChoice = option(  # noqa: RUF009  (option() is a dataclasses.field)
        factory=_auto,
        help="a strategy's name (``paratrain.strategies()``) or its choice with the options only "
        'it reads, e.g. ``paratrain.strategies.FSDP(blocks=("Block",))`` or '
        '``paratrain.strategies.Pipeline(split=..., schedule="1f1b", microbatches=4)``; '
        "auto: ddp under torchrun or on 2+ GPUs, else cuda, mps, cpu",
        flag="--strategy",
        check=_strategy,
    )
    devices: str | None = option(
        None,
        "a count (2) or a list (0,1 / cuda:0,cuda:1 / cpu,cpu); default: the strategy's",
        flag="--devices",
        check=_devices,
    )
    precision: str = option("32", "32, bf16 or fp16", flag="--precision", check=_precision)
    seed: int | None = option(
        None,
        "None leaves every random generator as the script set it, and loaders draw their "
        "order from them as torch's DataLoader does; an int seeds Python, NumPy and torch "
        "with it, and loaders shuffle with their own generator seeded with ``seed + epoch`` "
        "(paratrain.data.loaders)",
        flag="--seed",
    )
    accumulate: int = option(
        1,
        "micro-batches per optimizer step",
        flag="--accumulate",
        check=_at_least_one("--accumulate"),
    )
    sync_batchnorm: bool = option(
        False, "BatchNorm -> SyncBatchNorm (across processes)", flag="--sync-batchnorm"
    )
    deterministic: bool = option(
        False,
        "reproducible on GPUs, and the CPU thread count of a quiet machine whatever the load "
        "(paratrain.runtime.determinism)",
        flag="--deterministic",
    )
    #: compile, channels_last, fused_optimizer (declared in paratrain.runtime.speed)
    speed: SpeedOptions = field(default_factory=_speed)
    batch_size_per: str = option(
        "global",
        "what a loader's batch_size means: the global batch (every layout the same) or each "
        "process's (paratrain.runtime.batching)",
        flag="--batch-size-per",
        check=check_batch_size_per,
    )
    threads: int | None = option(
        None,
        "intra-op threads of each process (default: the cores other work leaves free when "
        "it starts, paratrain.launching.threads)",
        flag="--threads",
        check=_at_least_one("--threads"),
    )
    oom: str = option(
        "off",
        "auto: a micro-batch that runs out of memory in rt.forward_backward is redone in "
        "smaller pieces, the same step (paratrain.runtime.oom); off: the error is raised",
        flag="--oom",
        check=_oom,
    )
    activation_checkpointing: bool = option(
        False,
        "each block recomputes its activations in the backward: less memory, one more "
        "forward per step (paratrain.runtime.activation_checkpointing)",
        flag="--activation-checkpointing",
    )
    nonfinite: str = option(
        help="a NaN or infinite loss on any process: error (every process raises), skip (its "
        "backward is skipped on every process) or off (no check); default: "
        "PARATRAIN_NONFINITE, else error (paratrain.runtime.nonfinite)",
        flag="--skip-nonfinite",
        check=_nonfinite,
        factory=nonfinite_from_env,
    )
    hang_timeout: float | None = option(
        None,
        "rt.launch stops the run when a process makes no progress for this many seconds "
        "(default: PARATRAIN_HANG_TIMEOUT, else 600; 0: off; paratrain.launching.watchdog)",
        flag="--hang-timeout",
        check=check_hang_timeout,
    )

    agreement_seconds: float = option(
        1.0,
        "several processes: seconds between two agreements of the step's checks (a NaN or "
        "infinite loss, a stop signal) on batches of rt.setup_loader, which every process "
        "has the same number of; 0: every step. A check is acted on within about this long, "
        "at each epoch's end, before rt.save, rt.save_weights and rt.settle, and when the "
        "program ends; batches the loop made itself, --oom auto and --skip-nonfinite agree "
        "at every step (paratrain.runtime.agreement)",
        flag="--agreement-seconds",
        check=_non_negative_seconds,
        cli={"type": float, "metavar": "SECONDS"},
    )
    collective_check: bool = option(
        True,
        "processes that disagree about the next collective (a half-ported script: rt.save "
        "under a rank guard, loops of unequal length, tensors of different dtypes or shapes) "
        "are stopped with one message instead of hanging or pairing unrelated calls; False "
        "(--no-collective-check): no check, no background thread and no small all-reduce "
        "before rt.all_reduce, rt.all_gather, rt.broadcast_object, rt.barrier, rt.save, "
        "rt.load, rt.save_weights and a shuffled loader's epoch, for the last microseconds "
        "of each collective (paratrain.distributed.collective_order, "
        "paratrain.runtime.call_check)",
        flag="--no-collective-check",
        cli={"action": "store_false", "default": None},
    )
    replicate: int = option(
        1,
        "copies of the layout, data parallel across them (each copy takes its own part of "
        "each batch); the strategy's own dimension gets the processes // replicate: fsdp "
        "shards within a copy and all-reduces across copies (HSDP), pipeline runs one stage "
        "per process of a copy and averages each stage's gradients across copies "
        "(paratrain.distributed.mesh)",
        flag="--replicate",
        check=_at_least_one("--replicate"),
        cli={"type": int, "metavar": "N"},
    )
    tp: int = option(
        1,
        "processes that split each layer between them (tensor parallel: attention heads and "
        "the MLP's width), consecutive ranks that take the same batches; fsdp shards over "
        "the processes // tp groups (a shard x tp mesh, paratrain.strategies.tensor_parallel); "
        "fsdp and the built-in GPT only",
        flag="--tp",
        check=_at_least_one("--tp"),
        cli={"type": int, "metavar": "N"},
    )

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            check = spec.metadata.get("check")
            if check is not None:
                object.__setattr__(self, spec.name, check(getattr(self, spec.name)))
        from paratrain.strategies import check_replicate, check_tp

        check_replicate(self.strategy, self.replicate)
        check_tp(self.strategy, self.tp)

    @classmethod
    def of(cls, **given: Any) -> RuntimeConfig:
        """The configuration of ``Runtime(...)``'s keywords (every one of
        :func:`runtime_keywords`, flat ones included), checked; ``strategy="auto"`` and
        ``devices=None`` take `paratrain run`'s choice from the environment."""
        if str(given.get("strategy", AUTO)) == AUTO:
            given["strategy"] = environment.current().get(STRATEGY_VARIABLE) or AUTO
        if given.get("devices") is None:
            given["devices"] = environment.current().get(DEVICES_VARIABLE) or None
        return cls.from_keywords(**given)

    @classmethod
    def from_keywords(cls, **given: Any) -> RuntimeConfig:
        """The configuration of ``Runtime(...)``'s keywords, flat ones included, checked
        (the environment's `paratrain run` choices aside)."""
        from paratrain.runtime.speed import SpeedOptions
        from paratrain.strategies import FLAT_OWNERS, choose

        strategy = given.pop("strategy", AUTO)
        flat = {name: given.pop(name) for name in FLAT_OWNERS if name in given}
        speed = {
            f.name: given.pop(f.name) for f in dataclasses.fields(SpeedOptions) if f.name in given
        }
        if given.get("nonfinite", "") is None:
            del given["nonfinite"]  # the default: PARATRAIN_NONFINITE
        return cls(strategy=choose(strategy, **flat), speed=SpeedOptions.of(**speed), **given)

    @property
    def num_processes(self) -> int:
        """How many processes this runtime runs in (``rt.launch`` starts them), without
        building its strategy."""
        from paratrain.strategies import count_processes

        return count_processes(self.strategy, self.devices)

    @property
    def strategy_name(self) -> str:
        """The strategy this configuration runs (``auto`` resolved on this machine)."""
        from paratrain.strategies import resolved_name

        return resolved_name(self.strategy, self.devices)

    @property
    def options(self) -> StrategyOptions:
        """What the strategy is built with: its choice's options, the run's precision."""
        from paratrain.strategies import options_for

        return options_for(
            self.strategy,
            self.precision,
            collective_check=self.collective_check,
            replicate=self.replicate,
            tp=self.tp,
        )

    def validate(self) -> RuntimeConfig:
        """Checks the strategy and devices too (the options are checked when built)."""
        self.num_processes  # noqa: B018  (UserError for an unknown strategy or bad devices)
        return self


def runtime_keywords() -> Iterator[tuple[str, Any, str]]:
    """``Runtime(...)``'s keywords: name, default and help text, in the declarations'
    order (nested ones and the strategies' flat options in place)."""
    from paratrain.runtime.speed import SpeedOptions
    from paratrain.strategies import FLAT_OWNERS, flat_default

    for spec in dataclasses.fields(RuntimeConfig):
        if spec.name == "speed":
            for inner in dataclasses.fields(SpeedOptions):
                yield inner.name, inner.default, inner.metadata.get("help", "")
            continue
        default = spec.default if spec.default is not dataclasses.MISSING else None
        yield spec.name, default, spec.metadata.get("help", "")
        if spec.name == "strategy":
            for flat, owner in FLAT_OWNERS.items():
                help_text = f"the same as ``strategy={owner.__name__}({owner.flat[flat]}=...)``"
                yield flat, flat_default(flat), help_text


def command_line_options() -> Iterator[tuple[str, dict[str, Any]]]:
    """The flags generated from the declarations that give their argparse form: the flag
    and ``add_argument``'s keywords (an option left out stays None)."""
    for spec in dataclasses.fields(RuntimeConfig):
        cli = spec.metadata.get("cli")
        if cli is not None:
            help_text = spec.metadata["help"].replace("%", "%%")
            yield spec.metadata["flag"], {"dest": spec.name, "help": help_text, **cli}


def runtime_help() -> str:
    """The options of ``Runtime(...)``, one paragraph each, for its docstring."""
    lines = ["The options, each also a field of :class:`RuntimeConfig`:", ""]
    for name, default, help_text in runtime_keywords():
        lines.append(f"``{name}`` (default ``{default!r}``): {help_text}.")
    return "\n".join(lines)
