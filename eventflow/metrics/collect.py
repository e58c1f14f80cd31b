"""The expensive readings, taken at scrape time rather than per message: each consumer's
lag (one ``Broker.lag`` call each), the dead letters per group, the outbox, the
projections' lag, the sagas by status and their timers.

A :class:`Sampler` takes them all concurrently, each part bounded by ``timeout`` and kept
apart: a part that fails (the broker is down) keeps its last reading, counts an error
under its name, and does not hold the others back. Readings younger than ``min_interval``
are reused, so scrapes from several Prometheus servers (or a dashboard's refresh) cost one
round of reads. Nothing here imports ``prometheus_client``: the registry turns a
:class:`Sample` into metric families.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from .._logging import Throttled
from ..envelope import Envelope
from ..ports import Lag, Outbox, Store, declared
from ..projections import Projection
from ..runtime.consumer import Consumer
from ..runtime.deadletters import DeadLetters
from ..sagas.runtime import SagaRuntime, Sagas
from ..supervision import Health

__all__ = ["DEFAULT_MIN_INTERVAL", "DEFAULT_TIMEOUT", "MetricsHost", "Sample", "Sampler"]

DEFAULT_MIN_INTERVAL = 1.0
"""Seconds a reading is reused for before a scrape takes a new one."""
DEFAULT_TIMEOUT = 5.0
"""Seconds one part of a reading (one consumer's lag, the DLQ count, ...) may take."""
_CAP = 1000  # rows read at most to count the outbox and the timers (the gauge says "up to")
_log = logging.getLogger("eventflow.metrics")


class MetricsHost(Protocol):
    """What the metrics read of the app they belong to (``App`` satisfies it)."""

    @property
    def consumers(self) -> Sequence[Consumer]:
        """The running consumers."""

    @property
    def projections(self) -> tuple[Projection, ...]:
        """The app's projections."""

    @property
    def store(self) -> Store:
        """The store: outbox, checkpoints, positions."""

    @property
    def dead_letters(self) -> DeadLetters:
        """The dead letters of the app's groups."""

    @property
    def dead_letter_groups(self) -> tuple[str, ...] | None:
        """The groups whose dead letters are the app's (None: every group's)."""

    @property
    def sagas(self) -> Sagas:
        """The sagas in the store."""

    def readiness(self) -> tuple[bool, Health]:
        """Whether ``/readyz`` answers ready, and the health behind it."""


@dataclass(slots=True)
class Sample:
    """One round of readings; NaN where a value was never read (its part failed so far)."""

    lag: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    """(group, topic pattern) -> (messages, seconds)."""
    partition_lag: dict[tuple[str, str, str], tuple[float, float]] = field(default_factory=dict)
    """(group, topic pattern, partition) -> (messages, seconds), where the broker has them."""
    dead_letters: dict[str, int] = field(default_factory=dict)
    outbox: tuple[float, float] = (math.nan, math.nan)
    """(pending messages, age of the oldest in seconds)."""
    projections: dict[str, tuple[float, float]] = field(default_factory=dict)
    """projection name -> (positions behind, seconds behind)."""
    sagas: dict[tuple[str, str], int] = field(default_factory=dict)
    """(saga name, status) -> count."""
    timers: dict[str, tuple[int, float]] = field(default_factory=dict)
    """saga name -> (timers pending, seconds the most overdue one is late)."""
    errors: dict[str, int] = field(default_factory=dict)
    """part -> reads that failed since the app started."""
    ready: bool = False
    """What ``/readyz`` said at the reading."""


class Sampler:
    """Takes :class:`Sample` readings of one app (see the module docstring)."""

    def __init__(
        self,
        app: MetricsHost,
        sagas: SagaRuntime | None = None,
        *,
        min_interval: float = DEFAULT_MIN_INTERVAL,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.app = app
        self.sagas = sagas
        self.min_interval = min_interval
        self.timeout = timeout
        self.sample = Sample()
        self._taken = -math.inf  # monotonic time of the last reading
        self._lock = asyncio.Lock()
        self._log = Throttled(_log)

    async def refresh(self) -> Sample:
        """A reading no older than ``min_interval`` (taken now if needed; concurrent
        callers share one)."""
        async with self._lock:
            if time.monotonic() - self._taken >= self.min_interval:
                await self._take()
                self._taken = time.monotonic()
        return self.sample

    async def _take(self) -> None:
        app = self.app
        self.sample.ready = app.readiness()[0]
        parts: list[tuple[str, Callable[[], Awaitable[None]]]] = []
        for consumer in app.consumers:
            key = (consumer.group, consumer.spec.pattern)
            parts.append((f"lag {consumer.name}", _bind(self._lag, key, consumer.lag)))
        live = {(c.group, c.spec.pattern) for c in app.consumers}
        for gone in set(self.sample.lag) - live:  # series end with their subscription
            del self.sample.lag[gone]
        partitions = self.sample.partition_lag
        for ended in [k for k in partitions if k[:2] not in live]:
            del partitions[ended]
        parts.append(("dead letters", self._dead_letters))
        parts.append(("outbox", self._outbox))
        for projection in app.projections:
            parts.append(
                (f"projection {projection.name}", _bind(self._projection, projection.name))
            )
        if self.sagas is not None and self.sagas.classes:
            parts.append(("sagas", self._sagas))
        await asyncio.gather(*(self._guarded(name, read) for name, read in parts))

    async def _guarded(self, name: str, read: Callable[[], Awaitable[None]]) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await read()
        except Exception as exc:
            errors = self.sample.errors
            errors[name] = errors.get(name, 0) + 1
            self._log.warning(
                name, "metrics: reading %s failed (%s: %s)", name, type(exc).__name__, exc
            )

    async def _lag(self, key: tuple[str, str], read: Callable[[], Awaitable[Lag]]) -> None:
        self.sample.lag.setdefault(key, (math.nan, math.nan))
        lag = await read()
        now = datetime.now(UTC)
        self.sample.lag[key] = (float(lag.messages), lag.age(now))
        for part in lag.partitions:
            self.sample.partition_lag[(*key, part.partition)] = (
                float(part.messages),
                part.age(now),
            )

    async def _dead_letters(self) -> None:
        counts = await self.app.dead_letters.count()
        groups = self.app.dead_letter_groups
        self.sample.dead_letters = {
            group: counts.get(group, 0) for group in (groups if groups is not None else counts)
        }

    async def _outbox(self) -> None:
        backlog = declared(self.app.store.outbox, Outbox, "backlog")
        count, oldest = await backlog(limit=_CAP)
        age = 0.0
        if oldest is not None:
            sent = Envelope.from_bytes(oldest.payload).time
            age = max(0.0, time.time() - sent.timestamp())
        self.sample.outbox = (float(count), age)

    async def _projection(self, name: str) -> None:
        store = self.app.store
        self.sample.projections.setdefault(name, (math.nan, math.nan))
        done = await store.checkpoints.get(name)
        end = await store.last_position()
        behind, age = max(0, end - done), 0.0
        if behind:
            async for record in store.read_all(after=done, limit=1):
                age = max(0.0, time.time() - record.envelope.time.timestamp())
        self.sample.projections[name] = (float(behind), age)

    async def _sagas(self) -> None:
        persistence = self.app.sagas.persistence
        counts = await persistence.counts()
        self.sample.sagas = counts
        assert self.sagas is not None
        names = sorted({cls.definition.name for cls in self.sagas.classes})
        timers: dict[str, tuple[int, float]] = {}
        for name in names:
            rows, now = await persistence.earliest(name, _CAP)
            overdue = max(0.0, now - rows[0].due) if rows else 0.0
            timers[name] = (len(rows), overdue)
        self.sample.timers = timers

    @property
    def conflicts(self) -> int:
        """Saga transitions that found their stream changed and were applied again: by the
        saga layer (at the append), or by the pipeline (at the commit, SQLite)."""
        if self.sagas is None or not self.sagas.classes:
            return 0
        again = sum(c.stats.applied_again for c in self.app.consumers)
        return self.app.sagas.conflicts + again


def _bind(fn: Callable[..., Awaitable[None]], *args: object) -> Callable[[], Awaitable[None]]:
    def call() -> Awaitable[None]:
        return fn(*args)

    return call
