"""Cluster-wide slots, rate and breaker: a limit of ``scope="cluster"`` over a
:class:`LimitBackend` (the app's SQL store, or Redis).

Slots are leases: each is a row or a member with an expiry on the backend's clock, renewed
every ``ttl / 3`` while held (``renew``, one call per limit for every slot this process
holds), so the slots of a process that died are free again ``ttl`` seconds after its last
renewal. A full limit is polled (5 ms, doubling to 100 ms, with jitter); a token is reserved
in the same atomic step as the slot, so waiting for the rate costs one sleep, not a poll.

The breaker's state is one shared record, changed by compare-and-set (a version number) with
the rules of :mod:`eventflow.limits.breaker`; each process reads it at most every
``_BREAKER_FRESH`` seconds (and after each change it makes), so an opening made by one
instance stops the others within that time, and a counted failure costs one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .breaker import Admission, BreakerState, Phase, admit, failed, finished_probe
from .errors import LimitTimeoutError
from .spec import Breaker, Limit

__all__ = ["Acquired", "LimitBackend", "SharedCell", "SharedSlots"]

_POLL_FIRST = 0.005
_POLL_MAX = 0.1
_BREAKER_FRESH = 0.5
_CAS_TRIES = 20


@dataclass(frozen=True, slots=True)
class Acquired:
    """What one ``LimitBackend.acquire`` did: ``ok`` True took the slot (if the limit has
    slots) and reserved a token ``wait`` seconds from now (if it has a rate); ``ok`` False
    took nothing: the slots are full (``wait`` 0.0) or the next token is ``wait`` seconds
    away, past what the caller may wait."""

    ok: bool
    wait: float = 0.0


@runtime_checkable
class LimitBackend(Protocol):
    """Where cluster limits keep their slots, rate buckets and breaker records, shared by
    every process using it. Every change is atomic; times are the backend's own clock."""

    async def open(self) -> None:
        """Connect and create what is missing (tables, scripts). Idempotent."""

    async def close(self) -> None:
        """Disconnect. Idempotent."""

    async def acquire(self, limit: Limit, slot: str, max_wait: float) -> Acquired:
        """In one atomic step: drop expired slots, then if fewer than ``limit.concurrency``
        are held and the next token is at most ``max_wait`` seconds away, hold ``slot`` for
        ``limit.ttl`` seconds and reserve the token."""

    async def release(self, limit: Limit, slot: str) -> None:
        """Free ``slot`` (nothing if it expired meanwhile)."""

    async def renew(self, limit: Limit, slots: Sequence[str]) -> None:
        """Extend the lease of each of ``slots`` still held to ``limit.ttl`` from now."""

    async def load_breaker(self, limit: Limit) -> tuple[BreakerState, int]:
        """The breaker's record and its version (a fresh closed state and 0 if none)."""

    async def store_breaker(self, limit: Limit, state: BreakerState, version: int) -> bool:
        """Write ``state`` as version ``version + 1`` if the record is still at ``version``;
        False if another process changed it first."""


class SharedSlots:
    """The slots and rate of one cluster limit, as this process takes them."""

    def __init__(self, limit: Limit, backend: LimitBackend) -> None:
        self.limit = limit
        self.backend = backend
        self.held: set[str] = set()

    @property
    def in_use(self) -> int:
        """Slots this process holds."""
        return len(self.held)

    async def take(self, timeout: float) -> str | None:
        """Take a slot (and a token) within ``timeout`` seconds, else ``LimitTimeoutError``."""
        limit, backend = self.limit, self.backend
        slot = uuid.uuid4().hex
        deadline = time.monotonic() + timeout
        delay = _POLL_FIRST
        while True:
            left = deadline - time.monotonic()
            got = await backend.acquire(limit, slot, max(left, 0.0))
            if got.ok:
                break
            if got.wait > 0 or left <= 0:  # the next token is beyond the deadline
                what = "rate token" if got.wait > 0 else "slot"
                raise LimitTimeoutError(limit.name, timeout, what)
            await asyncio.sleep(min(delay * (0.5 + random.random()), max(left, 0.0)))
            delay = min(delay * 2, _POLL_MAX)
        if limit.concurrency is not None:
            self.held.add(slot)
        if got.wait > 0:
            try:
                await asyncio.sleep(got.wait)
            except BaseException:
                await self._give_quietly(slot)
                raise
        return slot if limit.concurrency is not None else None

    async def _give_quietly(self, slot: str) -> None:
        with contextlib.suppress(Exception):  # it expires after the ttl
            await self.give(slot)

    async def give(self, slot: str | None) -> None:
        """Free a slot this process holds."""
        if slot is None:
            return
        self.held.discard(slot)
        await self.backend.release(self.limit, slot)

    async def renew(self) -> None:
        """Renew every slot this process holds (the renewer calls it every ``ttl / 3``)."""
        if self.held:
            await self.backend.renew(self.limit, tuple(self.held))


class SharedCell:
    """A cluster breaker: the shared record, cached for ``_BREAKER_FRESH`` seconds."""

    def __init__(self, limit: Limit, breaker: Breaker, backend: LimitBackend) -> None:
        self.limit = limit
        self.breaker = breaker
        self.backend = backend
        self.state = BreakerState()
        self._version = 0
        self._read_at = -1e9

    async def current(self) -> BreakerState:
        """The shared state, read again if the cached one is older than ``_BREAKER_FRESH``."""
        if time.monotonic() - self._read_at >= _BREAKER_FRESH:
            await self._load()
        return self.state

    async def _load(self) -> None:
        self.state, self._version = await self.backend.load_breaker(self.limit)
        self._read_at = time.monotonic()

    async def _change(self, rule: Callable[[BreakerState], BreakerState]) -> BreakerState:
        """Apply ``rule`` to the shared state by compare-and-set, reading it again after
        each lost race; a rule that changes nothing writes nothing."""
        for _ in range(_CAS_TRIES):
            new = rule(self.state)
            if new == self.state:
                return new
            if await self.backend.store_breaker(self.limit, new, self._version):
                self.state, self._version = new, self._version + 1
                self._read_at = time.monotonic()
                return new
            await self._load()
        return self.state  # contended past reason: others are changing it, they decide

    async def admit(self) -> tuple[Admission, BreakerState]:
        """Decide an entry now (a probe is taken by compare-and-set: one process wins)."""
        state = await self.current()
        if state.phase is not Phase.CLOSED:
            await self._load()  # deciding a probe on a stale record would run two
        decided: list[Admission] = []

        def rule(state: BreakerState) -> BreakerState:
            admission, new = admit(state, self.breaker, time.time())
            decided.append(admission)
            return new

        new = await self._change(rule)
        admission = decided[-1]
        if admission is Admission.PROBE and new.phase is not Phase.HALF_OPEN:
            admission = Admission.REFUSE  # lost the probe to another process
        return admission, new

    async def failed(self, *, probe: bool, error: str) -> BreakerState:
        """Count a failure in the shared record; return the state after it."""
        return await self._change(
            lambda s: failed(s, self.breaker, time.time(), probe=probe, error=error)
        )

    async def finished_probe(self, *, succeeded: bool) -> BreakerState:
        """The probe ended without a counted failure."""
        return await self._change(lambda s: finished_probe(s, succeeded=succeeded))

    async def changed(self, timeout: float) -> None:
        """Wait about ``_BREAKER_FRESH`` seconds (at most ``timeout``) and read the record."""
        await asyncio.sleep(max(0.0, min(timeout, _BREAKER_FRESH)))
        await self._load()
