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
    #: False when what decides it is out of doctor's sight: shown with ``--all`` only
    sure: bool = True

    def to_dict(self) -> dict[str, Any]:
        found = asdict(self)
        if self.sure:  # "sure": false marks the others (--all)
            del found["sure"]
        return found

    def text(self) -> str:
        rule = self.rule if self.sure else f"{self.rule}, unsure"
        return f"{self.file}:{self.line}: [{rule}] {self.message}\n    fix: {self.fix}"


@dataclass(frozen=True)
class Style:
    """What kind of training script this is, and where the manual ports it: a page of
    ``docs/``, and the section's title in quotes where the page has several."""

    name: str
    description: str
    section: str


@dataclass
class Diagnosis:
    """What doctor says of one script: ``findings`` it is sure of, and ``unsure`` ones
    (what decides them is out of its sight: shown with ``--all``)."""

    path: str
    style: Style
    findings: list[Finding] = field(default_factory=list)
    unsure: list[Finding] = field(default_factory=list)
    #: an entry script (a ``__main__`` guard, a launcher, a process group), not a module
    entry: bool = True

    def shown(self, every: bool = False) -> list[Finding]:
        return sorted([*self.findings, *self.unsure]) if every else self.findings

    def to_dict(self, every: bool = False) -> dict[str, Any]:
        return {
            "path": self.path,
            "style": self.style.name,
            "migration": self.style.section,
            "entry": self.entry,
            "findings": [f.to_dict() for f in self.shown(every)],
        }
