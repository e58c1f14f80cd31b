"""What one saga input did: its transitions (the history), the commands it sends, the
timers it sets and cancels; and an input kept before the start, decoded."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..events import Event
from .control import Action

__all__ = ["Command", "Early", "Outcome", "Transition"]


@dataclass(frozen=True)
class Transition:
    """One entry of a saga's history."""

    kind: str
    step: str | None
    at: datetime
    message_id: str | None
    detail: str = ""
    by: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form saved in the saga's stream."""
        return {
            "kind": self.kind,
            "step": self.step,
            "at": self.at.isoformat(),
            "message_id": self.message_id,
            "detail": self.detail,
            "by": self.by,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Transition:
        """Read back :meth:`as_dict`."""
        return cls(
            data["kind"],
            data.get("step"),
            datetime.fromisoformat(data["at"]),
            data.get("message_id"),
            data.get("detail", ""),
            data.get("by"),
        )


@dataclass(frozen=True)
class Command:
    """A command (or compensation) an input sends, with the id the machine gave it."""

    event: Event
    id: str
    step: str
    action: Action
    attempt: int
    compensates: str | None = None
    """For a compensation: the id of the command it undoes (None for a local step's)."""


@dataclass(frozen=True)
class Early:
    """An input kept before the start, decoded, to apply right after it."""

    event: Event
    message_id: str
    causation_id: str | None


@dataclass
class Outcome:
    """What one input did: to save, send and schedule."""

    transitions: list[Transition] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    messages: list[Event] = field(default_factory=list)  # plain events from timer methods
    timers_set: dict[str, tuple[float, str]] = field(default_factory=dict)  # key: (due, token)
    timers_cancelled: set[str] = field(default_factory=set)
    status: str | None = None
    """The saga's status once the input was applied (set by ``app.sagas`` retry, skip and
    abort: what a running app does next may change it before the caller reads it)."""

    @property
    def changed(self) -> bool:
        """False when the input changed nothing but the history (ignored)."""
        return any(t.kind != "ignored" for t in self.transitions)
