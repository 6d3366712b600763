"""Strategies by name. The CLI's choices and help text come from here."""

from __future__ import annotations

from typing import TypeVar

from paratrain.strategies.base import Strategy
from paratrain.utils.errors import UserError

_REGISTRY: dict[str, type[Strategy]] = {}
S = TypeVar("S", bound=type[Strategy])

AUTO = "auto"


def register(cls: S) -> S:
    """Class decorator: make a strategy available under ``cls.name``."""
    if cls.name in _REGISTRY or cls.name == AUTO:
        raise ValueError(f"strategy name {cls.name!r} is already taken")
    _REGISTRY[cls.name] = cls
    return cls


def strategy_names(include_auto: bool = True) -> list[str]:
    names = list(_REGISTRY)
    return [AUTO, *names] if include_auto else names


def strategy_class(name: str) -> type[Strategy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        valid = ", ".join(strategy_names())
        raise UserError(f"unknown strategy {name!r}; valid strategies: {valid}") from None


def describe_strategies() -> dict[str, str]:
    return {name: cls.description for name, cls in _REGISTRY.items()}
