"""In-process slots, rate and breaker: a limit of ``scope="process"``.

Slots are a counter with a queue of waiters (first come, first served); the rate is a
GCRA token bucket: each entry reserves the next free moment and sleeps until it, so waiting
entries are spaced ``1/rate`` apart without polling.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from .breaker import Admission, BreakerState, admit, failed, finished_probe
from .errors import LimitTimeoutError
from .spec import Breaker, Limit

__all__ = ["LocalCell", "LocalSlots"]


class LocalSlots:
    """The slots and the token bucket of one process-scope limit."""

    def __init__(self, limit: Limit) -> None:
        self.limit = limit
        self.in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tat = 0.0  # GCRA: the theoretical arrival time of the next entry (monotonic)
        self._tolerance = (limit.burst - 1) * limit.emission

    async def take(self, timeout: float) -> str | None:
        """Take a slot and a token within ``timeout`` seconds (else ``LimitTimeoutError``);
        return the slot's id (None: this limit has no slots)."""
        limit = self.limit
        began = time.monotonic()
        if limit.concurrency is not None:
            if self.in_use >= limit.concurrency or self._waiters:
                await self._wait_slot(timeout)
            self.in_use += 1
        if limit.rate is not None:
            now = time.monotonic()
            tat = max(self._tat, now)
            wait = tat - now - self._tolerance
            if wait > timeout - (now - began):
                self._free()
                raise LimitTimeoutError(limit.name, timeout, "rate token")
            self._tat = tat + limit.emission
            if wait > 0:
                try:
                    await asyncio.sleep(wait)
                except BaseException:
                    self._free()
                    raise
        return None

    async def _wait_slot(self, timeout: float) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.in_use -= 1  # handed a slot just as it gave up: pass it on
                self._waiters.remove(waiter)
                self._hand_on()
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise LimitTimeoutError(self.limit.name, timeout, "slot") from None
            raise
        self._waiters.remove(waiter)
        self.in_use -= 1  # reserved for this waiter by _hand_on; the caller takes it

    async def give(self, slot: str | None) -> None:
        """Give a slot back (a limit without slots ignores it)."""
        self._free()

    def _free(self) -> None:
        if self.limit.concurrency is None:
            return
        self.in_use -= 1
        self._hand_on()

    def _hand_on(self) -> None:
        assert self.limit.concurrency is not None
        if self.in_use >= self.limit.concurrency:
            return
        for waiter in self._waiters:
            if not waiter.done():
                self.in_use += 1  # reserved for that waiter
                waiter.set_result(None)
                return


class LocalCell:
    """A process-scope breaker: its state in memory, and an event for those waiting on it."""

    def __init__(self, breaker: Breaker) -> None:
        self.breaker = breaker
        self.state = BreakerState()
        self._changed: asyncio.Event | None = None

    def _set(self, state: BreakerState) -> BreakerState:
        if state.phase is not self.state.phase and self._changed is not None:
            self._changed.set()
            self._changed = None
        self.state = state
        return state

    async def admit(self) -> tuple[Admission, BreakerState]:
        """Decide an entry now."""
        admission, state = admit(self.state, self.breaker, time.time())
        return admission, self._set(state)

    async def failed(self, *, probe: bool, error: str) -> BreakerState:
        """Count a failure; return the state after it."""
        return self._set(failed(self.state, self.breaker, time.time(), probe=probe, error=error))

    async def finished_probe(self, *, succeeded: bool) -> BreakerState:
        """The probe ended without a counted failure."""
        return self._set(finished_probe(self.state, succeeded=succeeded))

    async def current(self) -> BreakerState:
        """The state now."""
        return self.state

    async def changed(self, timeout: float) -> None:
        """Return when the phase changes, or after ``timeout`` seconds."""
        if self._changed is None:
            self._changed = asyncio.Event()
        event = self._changed
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await event.wait()
        except TimeoutError:
            pass
