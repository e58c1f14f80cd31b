"""The ports: small async Protocols that adapters implement.

Core modules depend only on these; adapters (``eventflow/adapters/<technology>``) implement
them, and the contract suites in ``eventflow.testing`` check every adapter against the same
guarantees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Broker",
    "DeadLetter",
    "DeadLetterStore",
    "DedupStore",
    "Delivery",
    "Heartbeat",
    "Heartbeats",
    "Store",
    "Subscription",
]


@runtime_checkable
class Delivery(Protocol):
    """One delivery of one message to one consumer of a group.

    Guarantees: a delivery that is neither acked nor nacked when its subscription closes (or
    its consumer dies) is delivered again, to this or another member of the group, with
    ``delivery_count`` increased. Deliveries of one key reach a group in publish order.
    """

    @property
    def topic(self) -> str:
        """The topic the message was published to."""

    @property
    def payload(self) -> bytes:
        """The message bytes, as published."""

    @property
    def key(self) -> str | None:
        """The partition / ordering key, if any."""

    @property
    def headers(self) -> Mapping[str, str]:
        """Broker-level headers (not the envelope's)."""

    @property
    def delivery_count(self) -> int:
        """How many times this message has been delivered to this group, this one included."""

    @property
    def metadata(self) -> Mapping[str, Any]:
        """Broker position of the message (partition/offset, stream sequence) for dead letters."""

    async def ack(self) -> None:
        """Mark the message done for the group; it is not delivered again."""

    async def nack(self, delay: float = 0.0) -> None:
        """Give the message back for redelivery after ``delay`` seconds, keeping key order."""

    async def release(self) -> None:
        """Give the message back untouched: no handler saw it (a consumer shutting down with
        a fetched backlog), so this delivery does not count towards ``delivery_count``."""

    async def in_progress(self) -> None:
        """Tell the broker the handler is still working (extends an ack deadline, if any)."""


@runtime_checkable
class Subscription(Protocol):
    """A live membership of one consumer in a group, receiving topics matching a pattern."""

    @property
    def pattern(self) -> str:
        """The topic pattern this subscription receives."""

    @property
    def group(self) -> str:
        """The consumer group this subscription belongs to."""

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[Delivery]:
        """Return 1..max_messages deliveries, or an empty sequence after ``timeout`` seconds."""

    async def close(self) -> None:
        """Leave the group; unacked deliveries go back for redelivery. Idempotent."""


@runtime_checkable
class Broker(Protocol):
    """Publishes bytes to topics and runs consumer groups over NATS-style topic patterns.

    Guarantees: at-least-once delivery to every group subscribed to a matching pattern when
    the message was published; per-key order within a group; competing consumers within a
    group; bounded buffers, a full publisher waits and then raises ``BackpressureError``.
    """

    @property
    def url(self) -> str:
        """A URL naming this broker (without credentials)."""

    async def start(self) -> None:
        """Connect. Idempotent."""

    async def close(self) -> None:
        """Disconnect, closing every subscription. Idempotent."""

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Send ``payload`` to ``topic``; returns once the broker has accepted it."""

    async def subscribe(self, pattern: str, *, group: str) -> Subscription:
        """Join ``group`` on ``pattern``; messages published after this returns reach it."""


@runtime_checkable
class DedupStore(Protocol):
    """Remembers which (group, message id) pairs were handled to completion.

    Guarantees: after ``mark`` returns, ``seen`` returns True for that pair in every process
    sharing the store, for at least the store's retention period.
    """

    async def seen(self, group: str, message_id: str) -> bool:
        """Return True if ``message_id`` was marked handled for ``group``."""

    async def mark(self, group: str, message_id: str) -> None:
        """Record ``message_id`` as handled for ``group``. Idempotent."""

    async def close(self) -> None:
        """Release resources. Idempotent."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that could not be handled, with everything needed to inspect or replay it."""

    id: str
    topic: str
    group: str
    payload: bytes
    error: str
    attempts: int
    failed_at: datetime
    reason: str = "handler-failed"
    key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    envelope_id: str | None = None
    source: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class DeadLetterStore(Protocol):
    """Durable storage of dead letters (as durable as the store that holds it)."""

    async def add(self, letter: DeadLetter) -> None:
        """Store ``letter``; once this returns the message may be acked."""

    async def list(self, *, group: str | None = None, limit: int = 100) -> list[DeadLetter]:
        """Return up to ``limit`` letters, oldest first, optionally of one group."""

    async def get(self, letter_id: str) -> DeadLetter | None:
        """Return one letter, or None."""

    async def remove(self, letter_ids: Sequence[str]) -> int:
        """Delete letters; return how many existed."""

    async def count(self) -> dict[str, int]:
        """Return the number of letters per group."""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A running app instance's liveness record."""

    app: str
    instance: str
    host: str
    pid: int
    started_at: datetime
    last_seen: datetime
    subscriptions: tuple[str, ...] = ()
    stats: Mapping[str, int] = field(default_factory=dict)


@runtime_checkable
class Heartbeats(Protocol):
    """Where running apps record that they are alive."""

    async def beat(self, heartbeat: Heartbeat) -> None:
        """Insert or replace the record of ``heartbeat.instance``."""

    async def list(self) -> list[Heartbeat]:
        """Return every recorded instance, newest first."""

    async def remove(self, instance: str) -> None:
        """Delete an instance's record (on clean shutdown)."""

    async def prune(self, older_than: float) -> int:
        """Delete records not refreshed for ``older_than`` seconds (crashed instances)."""


@runtime_checkable
class Store(Protocol):
    """A storage backend: one connection pool behind the dedup store, dead letters and
    heartbeats (and, with the event store, streams), so they can share transactions."""

    @property
    def url(self) -> str:
        """The URL this store was opened from."""

    @property
    def dedup(self) -> DedupStore:
        """The store's dedup table."""

    @property
    def dead_letters(self) -> DeadLetterStore:
        """The store's dead letters."""

    @property
    def heartbeats(self) -> Heartbeats:
        """The store's heartbeat records."""

    async def open(self) -> None:
        """Connect and create the schema if needed. Idempotent."""

    async def close(self) -> None:
        """Disconnect. Idempotent."""
