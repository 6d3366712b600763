"""What a weights load did, and the table it shows when keys or shapes do not match."""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.utils.errors import UserError

Shape = tuple[int, ...]
ROWS_PER_KIND = 20  # long lists are cut; the counts in the headline stay exact


@dataclass(frozen=True)
class ShapeMismatch:
    key: str  # the model's name for it
    checkpoint_shape: Shape
    model_shape: Shape


@dataclass
class LoadReport:
    """``loaded``/``missing``: the model's key names; ``unexpected``: the checkpoint's."""

    loaded: list[str]
    missing: list[str]
    unexpected: list[str]
    mismatched: list[ShapeMismatch]
    source: str = "<dict>"
    #: what was done to match names (a removed prefix), and what may explain the rest
    hints: list[str] = field(default_factory=list)
    model_shapes: dict[str, Shape] = field(default_factory=dict, repr=False)
    checkpoint_shapes: dict[str, Shape] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """Every tensor of the model was loaded and nothing in the checkpoint was left over."""
        return not (self.missing or self.unexpected or self.mismatched)

    def headline(self) -> str:
        total = len(self.loaded) + len(self.missing) + len(self.mismatched)
        if self.ok:
            return f"loaded all {total} tensors of the model from {self.source}"
        parts = [
            f"{len(self.missing)} missing" if self.missing else "",
            f"{len(self.unexpected)} unexpected" if self.unexpected else "",
            _plural(len(self.mismatched), "shape mismatch", "shape mismatches"),
        ]
        problems = ", ".join(p for p in parts if p)
        return (
            f"weights from {self.source} do not match the model: {problems}; "
            f"{len(self.loaded)} of the model's {total} tensors match"
        )

    def table(self) -> str:
        """The headline, then one row per problem: key, what is wrong, both shapes."""
        lines = [self.headline()]
        rows: list[tuple[str, str, str, str]] = []
        rows += _cut(
            [(k, "missing", "-", _shape(self.model_shapes.get(k))) for k in self.missing],
            "missing",
        )
        rows += _cut(
            [
                (k, "unexpected", _shape(self.checkpoint_shapes.get(k)), "-")
                for k in self.unexpected
            ],
            "unexpected",
        )
        rows += _cut(
            [
                (m.key, "shape", _shape(m.checkpoint_shape), _shape(m.model_shape))
                for m in self.mismatched
            ],
            "shape mismatches",
        )
        if rows:
            header = ("key", "problem", "checkpoint", "model")
            widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
            for row in [header, *rows]:
                cells = [cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)]
                lines.append(("  " + "  ".join([*cells, row[3]])).rstrip())
        lines += [f"hint: {hint}" for hint in self.hints]
        if not self.ok and self.loaded:
            lines.append(
                f"strict=False loads the {len(self.loaded)} matching tensors and skips the rest"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class WeightsMismatchError(UserError):
    """A strict load found missing, unexpected or mis-shaped tensors; nothing was loaded."""

    def __init__(self, report: LoadReport) -> None:
        super().__init__(report.table())
        self.report = report


def _cut(rows: list[tuple[str, str, str, str]], what: str) -> list[tuple[str, str, str, str]]:
    if len(rows) <= ROWS_PER_KIND:
        return rows
    more = len(rows) - ROWS_PER_KIND
    return [*rows[:ROWS_PER_KIND], (f"... and {more} more {what}", "", "", "")]


def _shape(shape: Shape | None) -> str:
    if shape is None:
        return "?"
    return "(" + ", ".join(map(str, shape)) + ")" if shape else "scalar"


def _plural(n: int, one: str, many: str) -> str:
    if n == 0:
        return ""
    return f"1 {one}" if n == 1 else f"{n} {many}"
