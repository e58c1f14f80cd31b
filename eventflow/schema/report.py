"""The findings of ``eventflow schema check``: :class:`Problem` and :class:`CheckReport`.

``--json`` prints :meth:`CheckReport.to_json`, a stable structure::

    {"ok": false, "registry": "schemas",
     "summary": {"types": 3, "versions": 4, "errors": 1, "warnings": 0, "examples": 6},
     "problems": [{"severity": "error", "rule": "type-changed", "type": "order.placed",
                   "version": 2, "against": 1, "direction": "backward", "path": "qty",
                   "message": "...", "hint": "..."}],
     "types": {"order.placed": {"compatibility": "backward", "latest": 2, "versions": [1, 2],
                                "upcasters": [1], "in_code": true, "retired": false}}}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["CheckReport", "Problem"]


@dataclass(frozen=True)
class Problem:
    """One finding of ``schema check``: which type, version and field, the rule, what to do."""

    severity: Literal["error", "warning"]
    rule: str
    type: str
    version: int | None
    path: str
    message: str
    hint: str
    against: int | None = None
    """The other version of a compatibility finding."""
    direction: str | None = None
    """``backward`` or ``forward`` for compatibility findings."""

    def to_json(self) -> dict[str, Any]:
        """The stable ``--json`` form."""
        return asdict(self)

    def __str__(self) -> str:
        where = f"{self.type} v{self.version}" if self.version is not None else self.type
        if self.path:
            where += f" field {self.path!r}"
        return f"{self.severity}: {where}: {self.message} [{self.rule}]\n  fix: {self.hint}"


@dataclass
class CheckReport:
    """The outcome of a check: the problems found and what was looked at."""

    directory: str
    problems: list[Problem] = field(default_factory=list)
    types: dict[str, dict[str, Any]] = field(default_factory=dict)
    examples_run: int = 0

    @property
    def errors(self) -> list[Problem]:
        """The problems that fail the check."""
        return [p for p in self.problems if p.severity == "error"]

    @property
    def ok(self) -> bool:
        """True when no problem is an error."""
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        """The stable ``--json`` document."""
        return {
            "ok": self.ok,
            "registry": self.directory,
            "summary": {
                "types": len(self.types),
                "versions": sum(len(t["versions"]) for t in self.types.values()),
                "errors": len(self.errors),
                "warnings": len(self.problems) - len(self.errors),
                "examples": self.examples_run,
            },
            "problems": [p.to_json() for p in self.problems],
            "types": self.types,
        }

    def render(self) -> str:
        """The human form: one block per problem, then a summary line."""
        lines = [str(p) for p in self.problems]
        summary = self.to_json()["summary"]
        verdict = "passed" if self.ok else "FAILED"
        lines.append(
            f"schema check {verdict}: {summary['types']} types, {summary['versions']} versions, "
            f"{summary['examples']} upcast examples, {summary['errors']} errors, "
            f"{summary['warnings']} warnings ({self.directory})"
        )
        return "\n".join(lines)
