"""``Limiter``: one declared limit as handlers take it, whatever its scope: the breaker's
check, then a slot and a token on the way in; the slot back and the breaker's count on the
way out. ``Taken`` is what ``async with ctx.limit(name):`` enters.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from .breaker import Admission, BreakerState, Phase
from .errors import CircuitOpenError, GivenBack, LimitTimeoutError
from .spec import Limit

__all__ = ["Cell", "Limiter", "LimiterStats", "Slots", "Taken"]

_log = logging.getLogger("eventflow.limits")


class Slots(Protocol):
    """A limit's slots and rate (``LocalSlots``, ``SharedSlots``)."""

    @property
    def in_use(self) -> int:
        """Slots this process holds."""

    async def take(self, timeout: float) -> str | None:
        """Take a slot and a token within ``timeout`` seconds, else ``LimitTimeoutError``."""

    async def give(self, slot: str | None) -> None:
        """Give back what ``take`` returned."""


class Cell(Protocol):
    """A limit's breaker state (``LocalCell``, ``SharedCell``)."""

    state: BreakerState

    async def admit(self) -> tuple[Admission, BreakerState]:
        """Decide an entry now."""

    async def failed(self, *, probe: bool, error: str) -> BreakerState:
        """Count a failure; return the state after it."""

    async def finished_probe(self, *, succeeded: bool) -> BreakerState:
        """The probe ended without a counted failure."""

    async def current(self) -> BreakerState:
        """The state now."""

    async def changed(self, timeout: float) -> None:
        """Return when the state may have changed, or after ``timeout`` seconds."""


@dataclass(slots=True)
class LimiterStats:
    """Counters of one limit in this process."""

    entered: int = 0
    timed_out: int = 0
    """Entries that got no slot or token within the timeout (the message given back)."""
    refused: int = 0
    """Entries refused by the open breaker (the message given back)."""
    counted: int = 0
    """Failures the breaker counted."""


class Limiter:
    """One declared limit in this process: its slots, rate and breaker."""

    def __init__(self, limit: Limit, slots: Slots, cell: Cell | None) -> None:
        self.limit = limit
        self.slots = slots
        self.cell = cell
        self.stats = LimiterStats()
        self._on = limit.breaker.on if limit.breaker is not None else ()
        self._reset = limit.breaker.reset if limit.breaker is not None else 0.0

    def take(self, timeout: float | None = None) -> Taken:
        """The context manager of one entry (``timeout`` overrides the limit's)."""
        return Taken(self, self.limit.timeout if timeout is None else timeout)

    async def enter(self, timeout: float) -> tuple[str | None, bool]:
        """Pass the breaker, then take a slot and a token; return the slot and whether this
        entry is the breaker's probe."""
        probe = False
        cell = self.cell
        if cell is not None:
            admission, state = await cell.admit()
            if admission is Admission.REFUSE:
                self.stats.refused += 1
                raise CircuitOpenError(self.limit.name, state.retry_at(self._reset), _detail(state))
            probe = admission is Admission.PROBE
        try:
            slot = await self.slots.take(timeout)
        except BaseException as exc:
            if isinstance(exc, LimitTimeoutError):
                self.stats.timed_out += 1
            if probe and cell is not None:
                await cell.finished_probe(succeeded=False)  # let the next entry probe
            raise
        self.stats.entered += 1
        return slot, probe

    async def exit(
        self, slot: str | None, probe: bool, error: BaseException | None
    ) -> CircuitOpenError | None:
        """Give the slot back and tell the breaker how the block ended. Returns the error to
        raise instead of the block's: a counted failure after which the breaker is not
        closed (it opened it, or the breaker was open or half-open) spends no attempt."""
        try:
            await self.slots.give(slot)
        except Exception as exc:  # a cluster slot then expires after its ttl
            _log.warning("limit %s: could not free a slot: %s", self.limit.name, exc)
        cell = self.cell
        if cell is None:
            return None
        if error is not None and isinstance(error, self._on) and not isinstance(error, GivenBack):
            self.stats.counted += 1
            state = await cell.failed(probe=probe, error=f"{type(error).__name__}: {error}")
            if state.phase is Phase.CLOSED:
                return None
            return CircuitOpenError(self.limit.name, state.retry_at(self._reset), _detail(state))
        if probe:
            await cell.finished_probe(succeeded=error is None)
        return None

    async def wait_admitting(self) -> None:
        """Return once the breaker lets entries (or a probe) through."""
        cell = self.cell
        if cell is None:
            return
        while True:
            state = await cell.current()
            if state.phase is Phase.CLOSED:
                return
            wait = state.retry_at(self._reset) - time.time()
            if wait <= 0:
                return
            await cell.changed(wait)


def _detail(state: BreakerState) -> str:
    phase = "half-open, its probe running" if state.phase is Phase.HALF_OPEN else "open"
    return f"{phase} after {state.last_error}" if state.last_error else phase


class Taken:
    """``async with ctx.limit(name):``: one entry into a limit."""

    __slots__ = ("_limiter", "_probe", "_slot", "_timeout")

    def __init__(self, limiter: Limiter, timeout: float) -> None:
        self._limiter = limiter
        self._timeout = timeout
        self._slot: str | None = None
        self._probe = False

    async def __aenter__(self) -> None:
        self._slot, self._probe = await self._limiter.enter(self._timeout)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        instead = await self._limiter.exit(self._slot, self._probe, exc)
        if instead is not None:
            raise instead from exc
