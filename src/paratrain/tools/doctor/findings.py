"""What `paratrain doctor` reports: findings, and the diagnosis of one script."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, order=True)
class Finding:
    """One mistake at one place: where, which rule, what is wrong, and the fix."""

    file: str
    line: int
    rule: str
    message: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        return f"{self.file}:{self.line}: [{self.rule}] {self.message}\n    fix: {self.fix}"


@dataclass(frozen=True)
class Style:
    """What kind of training script this is, and where the manual ports it: a page of
    ``docs/``, and the section's title in quotes where the page has several."""

    name: str
    description: str
    section: str


@dataclass
class Diagnosis:
    path: str
    style: Style
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "style": self.style.name,
            "migration": self.style.section,
            "findings": [f.to_dict() for f in self.findings],
        }
