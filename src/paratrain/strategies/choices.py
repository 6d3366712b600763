"""Strategies as a configuration names them, each with the options only it reads.

    rt = paratrain.Runtime(strategy=paratrain.strategies.FSDP(blocks=("Block",)))

A choice is a small frozen value (it travels pickled to every process); the strategy it
stands for is built in each process by :func:`paratrain.strategies.build_strategy`. The
name alone (``strategy="fsdp"``) and the flat keywords of before (``fsdp_blocks=``,
``pipeline_split=``, ...) map onto the same objects (:func:`choose`), and a flat keyword
the chosen strategy does not read is refused here, in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from paratrain.utils.errors import UserError

AUTO = "auto"
#: pipeline schedules (torch.distributed.pipelining's)
SCHEDULES = ("1f1b", "gpipe")


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"a, b"`` or ``["a", "b"]`` -> ``("a", "b")``."""
    listed = value.split(",") if isinstance(value, str) else value
    return tuple(name.strip() for name in listed if name.strip())


@dataclass(frozen=True)
class StrategyChoice:
    """A strategy by ``name``, without options; the base of those that have some."""

    name: str = AUTO
    #: the flat keyword (``Runtime(...)``, ``TrainConfig``, ``--flag``) -> this class's field
    flat: ClassVar[Mapping[str, str]] = {}
    #: the layout runs in several copies (``replicate``), data parallel across them
    replicates: ClassVar[bool] = False
    #: the layout's layers can be split across processes (``tp``, tensor parallel)
    splits_layers: ClassVar[bool] = False

    def flat_options(self) -> dict[str, Any]:
        """This choice's options under their flat keywords (``fsdp_blocks``, ...)."""
        return {flat: getattr(self, name) for flat, name in self.flat.items()}

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Auto(StrategyChoice):
    """ddp under torchrun or on 2+ GPUs (unless ``devices`` names one), else cuda, mps, cpu."""

    name: str = field(default=AUTO, init=False)


@dataclass(frozen=True)
class CPU(StrategyChoice):
    name: str = field(default="cpu", init=False)


@dataclass(frozen=True)
class CUDA(StrategyChoice):
    name: str = field(default="cuda", init=False)


@dataclass(frozen=True)
class MPS(StrategyChoice):
    name: str = field(default="mps", init=False)


@dataclass(frozen=True)
class DP(StrategyChoice):
    name: str = field(default="dp", init=False)


@dataclass(frozen=True)
class DPBalanced(StrategyChoice):
    name: str = field(default="dp-balanced", init=False)


@dataclass(frozen=True)
class DDP(StrategyChoice):
    name: str = field(default="ddp", init=False)


@dataclass(frozen=True)
class FSDP(StrategyChoice):
    """``blocks``: class names (``"TransformerBlock"``) or module names of the blocks
    sharded as one unit each (default: the model's repeated layers)."""

    name: str = field(default="fsdp", init=False)
    blocks: tuple[str, ...] = ()
    flat: ClassVar[Mapping[str, str]] = {"fsdp_blocks": "blocks"}
    replicates: ClassVar[bool] = True  # HSDP: sharded within a copy, replicated across
    splits_layers: ClassVar[bool] = True  # fsdp x tensor parallel

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", _names(self.blocks))


@dataclass(frozen=True)
class Pipeline(StrategyChoice):
    """``split``: the modules that start stages 2, 3, ... (default: balanced by parameter
    count); ``schedule``: "1f1b" or "gpipe"; ``microbatches``: per batch (fewer where a
    batch does not split evenly)."""

    name: str = field(default="pipeline", init=False)
    split: tuple[str, ...] = ()
    schedule: str = "1f1b"
    microbatches: int = 4
    flat: ClassVar[Mapping[str, str]] = {
        "pipeline_split": "split",
        "pipeline_schedule": "schedule",
        "pipeline_microbatches": "microbatches",
    }
    replicates: ClassVar[bool] = True  # copies of the pipeline, each on its part of a batch

    def __post_init__(self) -> None:
        object.__setattr__(self, "split", _names(self.split))
        if self.schedule not in SCHEDULES:
            raise UserError(
                f"--pipeline-schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}"
            )
        if self.microbatches < 1:
            raise UserError(f"--pipeline-microbatches must be at least 1, got {self.microbatches}")


def choice_name(cls: type[StrategyChoice]) -> str:
    """The strategy name a choice class stands for."""
    return str(cls.__dataclass_fields__["name"].default)


#: the built-in strategies' choices by name
CHOICES: dict[str, type[StrategyChoice]] = {
    choice_name(cls): cls for cls in (Auto, CPU, CUDA, MPS, DP, DPBalanced, DDP, FSDP, Pipeline)
}

#: every flat keyword a strategy reads -> the choice class that reads it
FLAT_OWNERS: dict[str, type[StrategyChoice]] = {
    flat: cls for cls in CHOICES.values() for flat in cls.flat
}


def check_replicate(choice: StrategyChoice, replicate: int) -> None:
    """Refuses ``replicate`` copies of a layout that cannot run in several yet."""
    _check_dimension(choice, replicate, "--replicate", "replicates")


def check_tp(choice: StrategyChoice, tp: int) -> None:
    """Refuses ``tp`` (tensor parallel) for a layout that cannot split its layers yet."""
    _check_dimension(choice, tp, "--tp", "splits_layers")


def _check_dimension(choice: StrategyChoice, size: int, flag: str, able_to: str) -> None:
    """A mesh dimension of ``size`` > 1 only for the strategies whose ``able_to`` is set."""
    if size == 1 or getattr(choice, able_to):
        return
    able = [name for name, cls in CHOICES.items() if getattr(cls, able_to)]
    raise UserError(
        f"{flag} applies to --strategy {', '.join(able)} only, not {choice.name}; drop "
        f"{flag} or use --strategy {able[0]}"
    )


def flat_default(flat: str) -> Any:
    """The default of a flat keyword (``pipeline_schedule`` -> ``"1f1b"``)."""
    owner = FLAT_OWNERS[flat]
    return owner.__dataclass_fields__[owner.flat[flat]].default


def choose(strategy: str | StrategyChoice, **flat: Any) -> StrategyChoice:
    """The choice ``strategy`` names (or is), with the flat keywords ``flat`` applied; a
    keyword left at its default (or None) is not given. Refuses one the strategy does not read."""
    choice = _named(strategy) if isinstance(strategy, str) else strategy
    changes: dict[str, Any] = {}
    for key, value in flat.items():
        if key not in FLAT_OWNERS:
            raise TypeError(f"unknown strategy option {key!r}")
        if value is None or _same(value, flat_default(key)):
            continue  # not given
        option = "--" + key.replace("_", "-")
        if key not in choice.flat:
            owner = FLAT_OWNERS[key]
            owner_name = choice_name(owner)
            raise UserError(
                f"{option} applies to --strategy {owner_name} only, not {choice.name}; drop "
                f"{option} or use --strategy {owner_name}"
            )
        name = choice.flat[key]
        current = getattr(choice, name)
        default = type(choice).__dataclass_fields__[name].default
        if not _same(current, default) and not _same(current, value):
            raise UserError(
                f"{option} {value!r} and {type(choice).__name__}({name}={current!r}) "
                "disagree: give it once"
            )
        changes[name] = value
    return dataclasses.replace(choice, **changes) if changes else choice


def _named(name: str) -> StrategyChoice:
    cls = CHOICES.get(name)
    return cls() if cls is not None else StrategyChoice(name)  # a registered strategy


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, tuple) and isinstance(value, str | list | tuple):
        return _names(value) == default
    return bool(value == default)
