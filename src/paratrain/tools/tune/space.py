"""``--space NAME=DISTRIBUTION(ARGS)``: what a search samples, parsed without ``eval``.

    lr=loguniform(1e-3,1e-1)        a float, log-uniform between the bounds
    lr=uniform(0.01,0.1)            a float, uniform between the bounds
    lr=quniform(0.01,0.1,0.01)      uniform, rounded to a multiple of the last number
    batch_size=randint(16,129)      an integer, the upper bound excluded (as Ray's)
    batch_size=lograndint(16,257)   an integer, log-uniform, the upper bound excluded
    batch_size=choice(32,64,128)    one of the values, drawn at random
    precision=grid(32,bf16)         every value, in order: --trials N repeats the whole grid

Arguments are Python literals (numbers, strings, True/False), read with
``ast.literal_eval``; a bare word such as ``bf16`` is taken as a string. Ray is imported only
by :func:`param_space`, so bad input is found before Ray is needed.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

from paratrain.utils.errors import UserError

#: distribution -> its arguments, as a reader would write them
DISTRIBUTIONS = {
    "uniform": "low, high",
    "quniform": "low, high, q",
    "loguniform": "low, high",
    "randint": "low, high",
    "lograndint": "low, high",
    "choice": "value, ...",
    "grid": "value, ...",
}
_RANGES = {"uniform": 2, "quniform": 3, "loguniform": 2, "randint": 2, "lograndint": 2}
_INTEGER_RANGES = ("randint", "lograndint")
_LISTS = ("choice", "grid")
_SYNTAX = re.compile(r"\s*([A-Za-z_][\w-]*)\s*=\s*([A-Za-z_]\w*)\s*\((.*)\)\s*", re.DOTALL)
_BARE_WORD = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class Dimension:
    """One hyper-parameter: its name, distribution and arguments, and how it was written."""

    name: str
    distribution: str
    args: tuple[Any, ...]
    text: str

    @property
    def is_grid(self) -> bool:
        return self.distribution == "grid"

    def corners(self) -> tuple[Any, ...]:
        """Values a check can try: every listed value, else both bounds of a range (the
        upper one of an integer range is excluded, so it is the bound minus one)."""
        if self.distribution in _LISTS:
            return self.args
        low, high = self.args[0], self.args[1]
        return (low, high - 1) if self.distribution in _INTEGER_RANGES else (low, high)

    def to_ray(self) -> Any:
        """The Ray Tune search-space object for this dimension."""
        from ray import tune

        if self.distribution == "grid":
            return tune.grid_search(list(self.args))
        if self.distribution == "choice":
            return tune.choice(list(self.args))
        sampler = getattr(tune, self.distribution)
        return sampler(*self.args)


def parse_dimension(text: str, types: dict[str, type] | None = None) -> Dimension:
    """Parse one ``NAME=DISTRIBUTION(ARGS)``. With ``types`` (name -> the field's type), only
    those names are accepted and values must fit the type; ``UserError`` otherwise."""
    match = _SYNTAX.fullmatch(text)
    if match is None:
        raise UserError(
            f"--space {text!r}: expected NAME=DISTRIBUTION(ARGS), e.g. lr=loguniform(1e-3,1e-1)"
        )
    name, distribution, inner = match.group(1).replace("-", "_"), match.group(2), match.group(3)
    if distribution not in DISTRIBUTIONS:
        valid = ", ".join(f"{d}({a})" for d, a in DISTRIBUTIONS.items())
        raise UserError(f"--space {text!r}: unknown distribution {distribution!r}; valid: {valid}")
    if types is not None and name not in types:
        raise UserError(f"--space {text!r}: cannot tune {name!r}; tunable: {', '.join(types)}")
    args = _literals(text, inner)
    dimension = Dimension(name, distribution, args, text)
    _check_arguments(dimension)
    if types is not None:
        dimension = _typed(dimension, types[name])
    return dimension


def parse_space(texts: list[str], types: dict[str, type] | None = None) -> list[Dimension]:
    """Every ``--space``; a name given twice is refused."""
    dimensions = [parse_dimension(text, types) for text in texts]
    seen: set[str] = set()
    for dimension in dimensions:
        if dimension.name in seen:
            raise UserError(f"--space {dimension.text!r}: {dimension.name} is given twice")
        seen.add(dimension.name)
    return dimensions


def param_space(texts: list[str]) -> dict[str, Any]:
    """``Tuner(param_space=...)`` for ``texts``, strings in the grammar above, any names."""
    return to_ray(parse_space(texts))


def to_ray(dimensions: list[Dimension]) -> dict[str, Any]:
    return {d.name: d.to_ray() for d in dimensions}


def _literals(text: str, inner: str) -> tuple[Any, ...]:
    values: list[Any] = []
    for part in _split(inner):
        part = part.strip()
        if _BARE_WORD.fullmatch(part) and part not in ("True", "False", "None"):
            values.append(part)  # precision=choice(32,bf16): bf16 is a string
            continue
        try:
            value = ast.literal_eval(part)
        except (ValueError, SyntaxError):
            raise UserError(
                f"--space {text!r}: {part!r} is not a number, string or True/False"
            ) from None
        if not isinstance(value, (int, float, str, bool)):
            raise UserError(f"--space {text!r}: {part!r} is not a number, string or True/False")
        values.append(value)
    return tuple(values)


def _split(inner: str) -> list[str]:
    """Split on commas outside quotes; an empty argument list is no argument."""
    parts, current, quote = [], "", ""
    for char in inner:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == ",":
            parts.append(current)
            current = ""
            continue
        current += char
    if current.strip() or parts:
        parts.append(current)
    return parts


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_arguments(d: Dimension) -> None:
    where = f"--space {d.text!r}"
    if d.distribution in _LISTS:
        if not d.args:
            raise UserError(f"{where}: {d.distribution} needs at least one value")
        return
    wanted = _RANGES[d.distribution]
    if len(d.args) != wanted or not all(_is_number(a) for a in d.args):
        raise UserError(
            f"{where}: {d.distribution} takes {wanted} numbers ({DISTRIBUTIONS[d.distribution]})"
        )
    low, high = d.args[0], d.args[1]
    if d.distribution in _INTEGER_RANGES and not all(isinstance(a, int) for a in d.args):
        raise UserError(f"{where}: {d.distribution} takes integers")
    if not low < high:
        raise UserError(f"{where}: the lower bound must be below the upper one")
    if d.distribution.startswith("log") and low <= 0:
        raise UserError(f"{where}: {d.distribution} needs a positive lower bound")
    if d.distribution == "quniform" and not d.args[2] > 0:
        raise UserError(f"{where}: the step q must be positive")


def _typed(d: Dimension, kind: type) -> Dimension:
    """Check that every value the distribution gives fits the field's type."""
    where = f"--space {d.text!r}"
    if kind is float:
        if d.distribution in _LISTS and not all(_is_number(a) for a in d.args):
            raise UserError(f"{where}: {d.name} takes numbers")
        return d
    if kind is int:
        if d.distribution in _LISTS:
            if not all(isinstance(a, int) and not isinstance(a, bool) for a in d.args):
                raise UserError(f"{where}: {d.name} takes integers")
        elif d.distribution not in _INTEGER_RANGES:
            raise UserError(f"{where}: {d.name} is an integer: use randint, lograndint or choice")
        return d
    if d.distribution not in _LISTS:
        raise UserError(f"{where}: {d.name} takes listed values: use choice or grid")
    if kind is bool:
        if not all(isinstance(a, bool) for a in d.args):
            raise UserError(f"{where}: {d.name} takes True or False")
        return d
    # a string field: 32 and "32" are the same precision
    return Dimension(d.name, d.distribution, tuple(str(a) for a in d.args), d.text)
