"""``ConsumerStats``: the counters of one consumer (one subscription of one group).

``app.stats()`` returns them per consumer, heartbeats record them and ``eventflow status``
shows the non-zero ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["ConsumerStats"]


@dataclass(slots=True)
class ConsumerStats:
    """Counters of one consumer since it started."""

    received: int = 0
    handled: int = 0
    duplicates: int = 0
    failed: int = 0
    """Handler attempts that failed (raised or timed out), retried or dead-lettered after."""
    retries: int = 0
    dead_lettered: int = 0
    dropped: int = 0
    given_back: int = 0
    """Messages given back untouched after a failure around the handler (no attempt spent)."""
    redelivered: int = 0
    """Deliveries after one that ended without an outcome (a crash, a stop past the grace)."""
    cancels: int = 0
    """Compensations that reached the group before their command: they cancelled it (or
    found it cancelled by another compensation), and their handler was not called."""
    cancelled: int = 0
    """Messages skipped because a compensation cancelled them before the group handled them
    (not counted in ``duplicates``)."""
    applied_though_cancelled: int = 0
    """Messages handled outside ``ctx.transaction()`` (or with a dedup store apart from the
    store) while a compensation cancelled them: they took effect and their compensation was
    not handled. Each is logged as an error: it needs a person."""

    applied_again: int = 0
    """Handlings whose commit found a stream moved since the handler read or guessed it
    (SQLite's saga appends check their version at the commit): rolled back and applied
    again at once, in a fresh transaction, no attempt spent."""
    limited: int = 0
    """Messages given back untouched by a limit (its breaker open, or no slot in time): no
    attempt spent; they are handled later."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return asdict(self)
