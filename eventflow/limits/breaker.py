"""The circuit breaker's rules, as pure functions of its state: one place for them, used by
the in-process limiter and, through a compare-and-set on the shared record, by the cluster
one.

Closed: counted failures are kept while they are younger than ``window``; the
``failures``-th opens it. Open: every entry is refused until ``reset`` seconds after it
opened; then the first entry becomes the probe (half-open) and the others are refused
meanwhile. The probe's success closes it; a counted failure opens it again. A probe that
ends otherwise (an exception the breaker does not count) lets the next entry probe. A probe
that never ends (its process died) is replaced once ``probe_until`` has passed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from .spec import Breaker

__all__ = ["Admission", "BreakerState", "Phase", "admit", "failed", "finished_probe"]


class Phase(enum.Enum):
    """Where the breaker is."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class Admission(enum.Enum):
    """What ``admit`` decides for one entry."""

    PASS = "pass"
    PROBE = "probe"
    REFUSE = "refuse"


@dataclass(frozen=True, slots=True)
class BreakerState:
    """A breaker's state; wall times in Unix seconds."""

    phase: Phase = Phase.CLOSED
    failures: tuple[float, ...] = ()
    """Times of the counted failures still within the window (closed only)."""
    opened_at: float = 0.0
    probe_until: float = 0.0
    """Half-open: until when the running probe holds its turn (0.0: none runs)."""
    opened: int = 0
    """How many times it opened."""
    closed: int = 0
    """How many times a probe closed it."""
    last_error: str = ""
    """The counted failure that last opened it."""

    def retry_at(self, reset: float) -> float:
        """When an entry refused now should look again."""
        if self.phase is Phase.OPEN:
            return self.opened_at + reset
        if self.phase is Phase.HALF_OPEN:
            return self.probe_until
        return 0.0

    def to_json(self) -> dict[str, Any]:
        """The state as a JSON object (the shared record of a cluster breaker)."""
        return {
            "phase": self.phase.value,
            "failures": list(self.failures),
            "opened_at": self.opened_at,
            "probe_until": self.probe_until,
            "opened": self.opened,
            "closed": self.closed,
            "last_error": self.last_error,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BreakerState:
        """The state ``to_json`` wrote."""
        return cls(
            phase=Phase(data["phase"]),
            failures=tuple(float(t) for t in data["failures"]),
            opened_at=float(data["opened_at"]),
            probe_until=float(data["probe_until"]),
            opened=int(data["opened"]),
            closed=int(data["closed"]),
            last_error=str(data["last_error"]),
        )


def admit(state: BreakerState, breaker: Breaker, now: float) -> tuple[Admission, BreakerState]:
    """Decide an entry at ``now``: pass (closed), probe (this entry tests the dependency:
    the state becomes half-open with its turn held for ``reset`` seconds) or refuse."""
    phase = state.phase
    if phase is Phase.CLOSED:
        return Admission.PASS, state
    due = state.opened_at + breaker.reset if phase is Phase.OPEN else state.probe_until
    if now < due:
        return Admission.REFUSE, state
    return Admission.PROBE, replace(state, phase=Phase.HALF_OPEN, probe_until=now + breaker.reset)


def failed(
    state: BreakerState, breaker: Breaker, now: float, *, probe: bool, error: str
) -> BreakerState:
    """A counted failure at ``now``. Closed: counted in the window, and the ``failures``-th
    opens it. The probe's failure opens it again. Others (calls that began before it
    opened) change nothing."""
    if probe and state.phase is Phase.HALF_OPEN:
        return replace(
            state,
            phase=Phase.OPEN,
            opened_at=now,
            probe_until=0.0,
            opened=state.opened + 1,
            last_error=error,
        )
    if state.phase is not Phase.CLOSED:
        return state
    recent = (*tuple(t for t in state.failures if t > now - breaker.window), now)
    if len(recent) < breaker.failures:
        return replace(state, failures=recent)
    return replace(
        state,
        phase=Phase.OPEN,
        failures=(),
        opened_at=now,
        probe_until=0.0,
        opened=state.opened + 1,
        last_error=error,
    )


def finished_probe(state: BreakerState, *, succeeded: bool) -> BreakerState:
    """The probe ended without a counted failure: closed if it succeeded; if it raised
    something the breaker does not count, the next entry probes instead."""
    if state.phase is not Phase.HALF_OPEN:
        return state
    if succeeded:
        return replace(
            state, phase=Phase.CLOSED, failures=(), probe_until=0.0, closed=state.closed + 1
        )
    return replace(state, probe_until=0.0)
