"""The ports: small async Protocols that adapters implement.

Core modules depend only on these; adapters (``eventflow/adapters/<technology>``) implement
them, and the contract suites in ``eventflow.testing`` check every adapter against the same
guarantees.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from .envelope import Envelope
from .errors import ConfigurationError
from .events import Event, EventRegistry, default_registry

if TYPE_CHECKING:
    import asyncio

    from .leases import Lease
    from .supervision import Supervisor

__all__ = [
    "AttemptRecord",
    "Attempts",
    "Broker",
    "Checkpoints",
    "DeadLetter",
    "DeadLetterStore",
    "DedupStore",
    "Delivery",
    "EventStore",
    "Heartbeat",
    "Heartbeats",
    "Lag",
    "Leases",
    "Outbox",
    "OutboxMessage",
    "PartitionLag",
    "RecordedEvent",
    "Snapshot",
    "StartPosition",
    "Store",
    "StoreClock",
    "Subscription",
    "Transaction",
    "declared",
]


StartPosition = Literal["latest", "earliest"]
"""Where a consumer group that does not exist yet begins: at the end of its topics
(``"latest"``: only messages published from then on) or at the oldest message the broker
keeps (``"earliest"``). See :meth:`Broker.subscribe`."""


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """One partition's share of a :class:`Lag`: ``partition`` names it as its broker does
    (NATS: the partition number, ``"3"``; Kafka: the Kafka topic and partition,
    ``"orders/3"``), ``messages`` and ``oldest`` as in ``Lag``."""

    partition: str
    messages: int
    oldest: datetime | None

    def age(self, now: datetime) -> float:
        """Seconds from ``oldest`` to ``now``, at least 0; 0.0 when nothing is pending."""
        if self.oldest is None:
            return 0.0
        return max(0.0, (now - self.oldest).total_seconds())


@dataclass(frozen=True, slots=True)
class Lag:
    """How far a consumer group is behind on a topic pattern, as its broker tells it
    (:meth:`Broker.lag`).

    ``messages``: the group's messages on the pattern not yet handled: not yet delivered to
    it, plus delivered and not yet acked (Kafka: not yet committed), across every member,
    live or dead. ``oldest``: when the broker accepted the oldest of them (a UTC datetime,
    on the clock :meth:`Broker.lag` names); None when ``messages`` is 0, or when none of
    them is still in the broker (deleted by a retention limit before the group handled
    it). Its age, ``now - oldest``, is the group's lag in seconds.

    ``partitions``: the same per partition, where the broker has partitions (NATS and Kafka:
    every partition the group reads, those with nothing pending included; the memory
    broker: none). Left out of comparisons: two lags are equal when their totals are.
    """

    messages: int
    oldest: datetime | None
    partitions: tuple[PartitionLag, ...] = field(default=(), compare=False)

    def age(self, now: datetime) -> float:
        """Seconds from ``oldest`` to ``now`` (an aware datetime), at least 0; 0.0 when
        nothing is pending."""
        if self.oldest is None:
            return 0.0
        return max(0.0, (now - self.oldest).total_seconds())


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
    ``publish`` raises ``MessageRefusedError`` for a message the broker refuses for good
    (too large, not authorised, an invalid topic), ``PublishUnconfirmedError`` when the
    broker may have stored the message without confirming it (a timeout waiting for its
    acknowledgement, a connection lost after sending: maybe sent, so it may be delivered),
    and another ``BrokerError`` for a failure that may pass when the message was not sent
    (the broker is down, or answered that it stored nothing).

    ``App`` sends each envelope's id in the ``eventflow-id`` header. A broker with duplicate
    detection of its own (NATS: ``Nats-Msg-Id`` within the stream's duplicate window) knows
    a message by its send id: the ``eventflow-send-id`` header where present, else
    ``eventflow-id``. So a retried publish of one envelope may be stored once, while a
    deliberate re-send of a stored envelope (a dead-letter replay), which carries a send id
    of its own, is stored as a new message whatever the broker saw before; publishes with
    different send ids are always different messages. A broker without such detection
    ignores both headers (and delivers them as sent); consumers deduplicate by envelope id.

    Groups are created on the broker by their first ``subscribe`` (at its ``start``) or
    ahead by ``declare`` (``eventflow groups declare``). ``declare`` is a method of its
    own rather than a ``subscribe`` then ``close``: joining a group that has live members
    moves their partitions twice (a NATS reassignment, a Kafka rebalance) and waits for
    the join (a second or more on Kafka), while creating the group is one request per
    partition; and ``eventflow groups list`` asks the same question without creating
    anything (``create=False``), which no subscription can.
    """

    @property
    def url(self) -> str:
        """A URL naming this broker (without credentials)."""

    def problems(self) -> tuple[str, ...]:
        """What keeps the broker from working now, one line each naming the cause and since
        when (UTC), such as ``disconnected from NATS at URL since ...``; empty while it
        works. ``App.health`` reports them (``eventflow status`` shows ``DEGRADED``)."""

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Connect, failing within the adapter's connect timeout with a ``BrokerError`` that
        names the URL. Background work (pumps, group coordination) runs as components of
        ``supervisor`` (the app's), or of a supervisor of the broker's own when None, and
        is stopped by ``close``. Idempotent."""

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

    async def subscribe(
        self,
        pattern: str,
        *,
        group: str,
        start: StartPosition = "latest",
        temporary: bool = False,
    ) -> Subscription:
        """Join ``group`` on ``pattern``; messages published after this returns reach it.

        ``temporary=True`` makes a group for this one subscription (the caller names it
        uniquely; an app's reply listener): it begins at the end whatever ``start``, and
        goes when the subscription closes, so messages do not pile up for a member that
        will never come back (the memory broker drops it from its hub; NATS deletes its
        consumers, which the server also removes a minute after their last pull if the
        process died; Kafka keeps the group's committed offsets,
        which hold nothing back, until its ``offsets.retention.minutes``).

        ``start`` applies only when the group does not exist yet on the broker (see
        ``declare`` for what "exists" is): the group is then created at the end of the
        topics (``"latest"``: what was published before is not delivered to it) or at the
        oldest message the broker keeps (``"earliest"``), and its creation is logged
        (``eventflow.groups.log_new_group``). An existing group keeps its position: every
        message published since it exists reaches it, also those that came while it had
        no member, and a later ``start`` changes nothing. Any other value raises
        ``ConfigurationError``."""

    async def lag(self, pattern: str, *, group: str) -> Lag:
        """What ``group`` has not handled yet on ``pattern``, across every member of the
        group, including members of other processes and members that died and still hold
        partitions or messages; asked of the broker at each call (nothing cached).

        Handled means acked; on Kafka, committed. ``messages`` counts what was not yet
        delivered to the group plus what was delivered and not yet handled: NATS, each
        partition consumer's ``num_pending`` plus ``num_ack_pending``; Kafka, each
        partition's end offset minus the group's committed offset (from the partition's
        first offset where the group never committed), so an acked message counts until
        the member's next commit (``commit_interval``); NATS acks are sent without waiting
        for the server, so one counts for a moment after ``ack`` returned too.

        ``oldest`` is the publish time, on the broker's clock, of the first message not
        handled in each partition's order, the earliest over the partitions: the memory
        broker's ``time.time()`` when ``publish`` took it; NATS, the server's store time of
        the first message on the consumer's filter after its ack floor; Kafka, the
        timestamp of the record at the committed offset, which is the producer's clock
        when it sent the record (``CreateTime``, the topic default) or the broker's when
        it appended it (a topic with ``message.timestamp.type=LogAppendTime``). Where one
        clock stamps every message (memory, NATS, ``LogAppendTime``), every message
        stamped before ``oldest`` was handled (or deleted by a retention limit).

        A group nobody created yet (no ``subscribe`` or ``declare``) has ``Lag(0, None)``.
        Cost per call: memory none (it looks at its hub); NATS one consumer-info request
        per partition plus one message get per partition with messages pending, all
        concurrent; Kafka four requests with nothing pending (metadata, the group's
        coordinator, its committed offsets, the end offsets; a wildcard adds a metadata
        request), and with messages pending the first offsets and one fetch per partition
        leader more. Raises ``BrokerError`` when the broker cannot be asked (it is down,
        or does not answer within the adapter's bound)."""

    async def declare(
        self,
        pattern: str,
        *,
        group: str,
        start: StartPosition = "latest",
        create: bool = True,
    ) -> bool:
        """Whether ``group`` existed on ``pattern`` before this call; with ``create`` (the
        default) one that did not is created at ``start``, as ``subscribe`` would create it
        (logged the same way), but without joining or consuming, so messages published
        from then on wait for its first member. ``create=False`` only looks. Idempotent.

        A group "exists" where the broker keeps its position: the memory broker while a
        broker of its hub is open in this process; NATS while any of its partition
        consumers exists; Kafka while it has a committed offset on a partition of the
        topics matching ``pattern`` (Kafka then keeps offsets ``offsets.retention.minutes``
        past the group's last member, 7 days by default). Raises ``BrokerError`` when the
        broker cannot be asked, or cannot record a position (Kafka: no topic matches a
        wildcard ``pattern`` yet)."""


@runtime_checkable
class DedupStore(Protocol):
    """Remembers which (group, message id) pairs were handled to completion, or cancelled
    by a compensation before they were handled.

    Guarantees: after ``mark`` or ``mark_new`` returns, ``seen`` returns True for that pair
    in every process sharing the store, for at least the store's retention period. Of
    concurrent ``mark_new`` calls for one pair, from any processes sharing the store,
    exactly one returns True, and only its ``cancelled_by`` is recorded (the first record of
    a pair is never replaced).
    """

    async def seen(self, group: str, message_id: str) -> bool:
        """Return True if ``message_id`` was marked handled (or cancelled) for ``group``."""

    async def seen_many(self, group: str, message_ids: Sequence[str]) -> set[str]:
        """The ids of ``message_ids`` that ``seen`` would say were marked for ``group``, in
        one round trip where the backend allows (the consumer asks this for each fetched
        batch). An adapter that subclasses ``DedupStore`` inherits this loop over ``seen``."""
        return {m for m in message_ids if await self.seen(group, m)}

    async def mark(self, group: str, message_id: str) -> None:
        """Record ``message_id`` as handled for ``group``. Idempotent."""

    async def mark_new(
        self, group: str, message_id: str, *, cancelled_by: str | None = None
    ) -> bool:
        """Record the pair unless it is recorded already; return True if this call recorded
        it (atomic across processes, see the class). ``cancelled_by``: the message was not
        handled but cancelled by the compensation with that envelope id, which
        ``cancelled_by()`` then answers."""

    async def cancelled_by(self, group: str, message_id: str) -> str | None:
        """The id of the compensation that cancelled ``message_id`` for ``group`` before the
        group handled it; None if the pair was handled (or is not recorded)."""

    async def open(self) -> None:
        """Connect, within the adapter's connect timeout, else raise a ``StoreError`` naming
        the URL (a store's own dedup table is opened with its store). Idempotent."""

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
    """A running app instance's liveness record.

    ``health`` is ``ok``, ``degraded`` (a component is failing and being restarted) or
    ``failed`` (one cannot recover); ``problems`` has a line per such component.
    """

    app: str
    instance: str
    host: str
    pid: int
    started_at: datetime
    last_seen: datetime
    subscriptions: tuple[str, ...] = ()
    stats: Mapping[str, int] = field(default_factory=dict)
    health: str = "ok"
    problems: tuple[str, ...] = ()


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


# -- event store ---------------------------------------------------------------------------


class RecordedEvent:
    """One stored event: its stream, its version in the stream, its global position and its
    envelope. ``event`` decodes the envelope (upcast to the newest known version) with the
    record's ``registry`` on first use.

    Stores make records with the default registry; a reader with a registry of its own (an
    ``App``'s, a ``Repository``'s, a projection runner's) hands out ``with_registry(...)``
    copies, or calls ``decode(registry)``.
    """

    __slots__ = ("_event", "envelope", "position", "registry", "stream_id", "stream_version")

    def __init__(
        self,
        stream_id: str,
        stream_version: int,
        position: int,
        envelope: Envelope,
        registry: EventRegistry | None = None,
    ) -> None:
        self.stream_id = stream_id
        self.stream_version = stream_version
        self.position = position
        self.envelope = envelope
        self.registry: EventRegistry = default_registry if registry is None else registry
        """The registry ``event`` decodes with (its classes and upcasters)."""
        self._event: Event | None = None

    @property
    def event(self) -> Event:
        """The typed event, as ``registry`` decodes it (raises a ``DecodeError`` if its type
        is unknown to the registry); decoded once, then cached on the record."""
        if self._event is None:
            self._event = self.registry.decode(self.envelope)
        return self._event

    def decode(self, registry: EventRegistry) -> Event:
        """The typed event as ``registry`` decodes it (the cached ``event`` when it is the
        record's own registry)."""
        if registry is self.registry:
            return self.event
        return registry.decode(self.envelope)

    def with_registry(self, registry: EventRegistry) -> RecordedEvent:
        """This record with ``registry`` as its own (itself when it already is)."""
        if registry is self.registry:
            return self
        return RecordedEvent(
            self.stream_id, self.stream_version, self.position, self.envelope, registry
        )

    def __repr__(self) -> str:
        return (
            f"RecordedEvent({self.stream_id!r} v{self.stream_version} @{self.position} "
            f"{self.envelope.type})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RecordedEvent):
            return NotImplemented
        return (self.stream_id, self.stream_version, self.position, self.envelope) == (
            other.stream_id,
            other.stream_version,
            other.position,
            other.envelope,
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An aggregate's state at ``version`` of its stream (JSON-ready ``state``)."""

    stream_id: str
    version: int
    state: Mapping[str, Any]
    taken_at: datetime


@runtime_checkable
class Transaction(Protocol):
    """A store transaction a handler or projection shares with eventflow's own writes (dedup
    entry, outgoing messages, checkpoint): they all commit or roll back together.

    SQL takes one parameter style on every SQL store: PostgreSQL's numbered ``$1, $2, ...``
    (each number is that argument, so one may appear several times). SQLite runs it as its
    own ``?1, ?2, ...`` and refuses its other styles (``?``, ``:name``, ``@name``, ``$name``)
    with a ``ConfigurationError``, so SQL that runs on SQLite runs on PostgreSQL unchanged.
    The transaction belongs to the context that opened it: tasks created inside its block
    (``asyncio.gather``, a ``TaskGroup``, ``wait_for``) use it too, one statement at a time;
    once it has ended, ``execute`` and ``fetch`` raise ``StoreError``.
    """

    async def execute(self, sql: str, *args: Any) -> Any:
        """Run one statement; return the number of rows it changed (an int: inserted, updated or
        deleted; 0 for statements that change no rows, such as DDL or a ``SELECT``)."""

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Run a query and return every row as a tuple."""


@runtime_checkable
class EventStore(Protocol):
    """An append-only log of events in streams, with one gapless global order.

    Guarantees: ``append`` is atomic (all events or none) and checks ``expected_version``
    (None: any, 0: the stream must not exist, N: the stream is at version N), raising
    ``ConcurrencyError(stream, expected, actual)``; an event whose envelope id is already
    stored is skipped, so retried appends are idempotent. Positions start at 1, have no gaps
    and never change; ``read_all`` and ``subscribe`` deliver every committed event exactly
    once in position order, never skipping one committed late by a concurrent writer; one
    stream's events are in version order in the global order too.

    Inside the store's ``transaction()`` (and ``ctx.transaction()``) an append commits with
    the transaction or not at all, on every store: readers outside it see its events only
    once it committed (then with their positions); inside it, ``read_stream``,
    ``stream_version`` and ``expected_version`` see them. Another writer of a stream the
    transaction appended to waits for it to end, then finds the stream as it left it.
    """

    async def append(
        self,
        stream_id: str,
        events: Sequence[Event | Envelope],
        *,
        expected_version: int | None = None,
    ) -> int:
        """Append ``events`` to ``stream_id``; return the stream's new version."""

    def read_stream(
        self,
        stream_id: str,
        *,
        from_version: int | None = None,
        backwards: bool = False,
        limit: int | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        """Events of one stream in version order (from ``from_version``; newest first when
        ``backwards``, starting at the end when ``from_version`` is None)."""

    def read_all(self, *, after: int = 0, limit: int | None = None) -> AsyncIterator[RecordedEvent]:
        """Every event with a position greater than ``after``, in global order."""

    def subscribe(self, *, after: int = 0) -> AsyncIterator[RecordedEvent]:
        """Like ``read_all``, then follows new events live, forever (cancel to stop)."""

    async def correlated(self, correlation_id: str, *, limit: int = 100_000) -> list[RecordedEvent]:
        """The committed events whose envelope has ``correlation_id``, oldest first, at most
        ``limit``: found through an index on SQL stores (``eventflow trace``), not by
        reading the log."""

    async def stream_version(self, stream_id: str) -> int:
        """The stream's current version (0 when it does not exist)."""

    async def last_position(self) -> int:
        """The global position of the newest event (0 when the store is empty)."""

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        """Store (replace) the snapshot of ``snapshot.stream_id``."""

    async def load_snapshot(self, stream_id: str) -> Snapshot | None:
        """The latest snapshot of a stream, or None."""


@runtime_checkable
class Checkpoints(Protocol):
    """Named positions in the global order (projections, the outbox relay)."""

    async def get(self, name: str) -> int:
        """The position ``name`` has processed up to (0 if never set)."""

    async def set(
        self,
        name: str,
        position: int,
        *,
        tx: Transaction | None = None,
        lease: Lease | None = None,
    ) -> None:
        """Record ``position`` for ``name``; inside ``tx`` it commits with ``tx``. With
        ``lease`` (the holder's fencing token) it raises ``LeaseLostError`` and writes
        nothing unless the lease still has that epoch."""

    async def list(self) -> dict[str, int]:
        """Every checkpoint."""

    async def delete(
        self, name: str, *, tx: Transaction | None = None, lease: Lease | None = None
    ) -> None:
        """Forget ``name`` (a rebuild starts from 0); ``lease`` fences it as in ``set``."""


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    """A message waiting in the outbox to be sent to the broker by the relay."""

    seq: int
    topic: str
    key: str | None
    payload: bytes
    message_id: str


@runtime_checkable
class Outbox(Protocol):
    """Messages committed with a transaction, sent to the broker afterwards by a relay.

    Guarantees: messages added in a transaction exist iff it committed; ``pending`` returns
    them in the order they were added.
    """

    async def add(
        self, messages: Sequence[tuple[str, Envelope]], *, tx: Transaction | None = None
    ) -> None:
        """Queue (topic, envelope) pairs; inside ``tx`` they commit with it."""

    async def pending(self, limit: int = 100) -> list[OutboxMessage]:
        """The oldest queued messages."""

    async def backlog(self, limit: int = 1000) -> tuple[int, OutboxMessage | None]:
        """How many messages are queued (counted up to ``limit``) and the oldest of them,
        for metrics: unlike ``pending`` it changes nothing the relay's wake-ups rely on."""

    async def remove(self, seqs: Sequence[int], *, lease: Lease | None = None) -> None:
        """Delete sent messages; with ``lease`` (the relay's) it raises ``LeaseLostError``
        and deletes nothing unless the lease still has that epoch."""

    @property
    def added(self) -> asyncio.Event:
        """Set once messages may have been added: the relay clears it before each look at
        ``pending`` and, unless the look filled its batch, waits on it before looking again
        (so a wake-up it could not give delays a message until the relay's poll).

        Every ``add`` made through this outbox sets it (once its transaction committed, or
        earlier). Adds that other processes, or other store objects on the same store,
        commit set it too where the store can tell, within milliseconds of their commit:
        PostgreSQL's adds notify at commit and the store's listener connection hears them;
        SQLite's waiting relay checks whether the outbox's highest ``seq`` passed the
        highest it saw, a fraction of a millisecond apart while it is busy. A wake-up may
        be spurious (the relay then finds nothing), and one may be lost (a listener
        reconnecting sets it once it is back), so the relay also looks every second. The
        memory store is one process: only its own adds set it. An outbox that cannot tell
        returns an event that is never set (the relay then only polls)."""

    def relaying(self) -> AbstractAsyncContextManager[None]:
        """Entered by the outbox relay for as long as it holds the relay lease through this
        outbox's store: meanwhile the relay that sends these messages is in this process
        (``added`` wakes it), so an outbox that tells other processes of its adds need not
        (PostgreSQL then saves the notification and its commit-time cost). An outbox that
        does not tell other processes returns a context that does nothing."""


@runtime_checkable
class Leases(Protocol):
    """Named leases shared by every process using the store: one holder at a time, each
    holding with a new epoch (a fencing token). See :mod:`eventflow.leases` for the bound
    within which a holder learns that its lease is lost."""

    @property
    def ttl(self) -> float:
        """Seconds a lease outlives its holder's last renewal."""

    def hold(self, name: str) -> AbstractAsyncContextManager[Lease]:
        """Wait for the lease on ``name`` and keep it renewed for the block. If it is lost,
        the block is cancelled and ends with ``LeaseLostError``."""

    async def holder(self, name: str) -> str | None:
        """The owner holding ``name`` now, or None when it is free or expired."""

    async def fence(self, lease: Lease, tx: Transaction) -> None:
        """Fence the transaction ``tx`` by ``lease`` (the holder's fencing token), so that
        ``tx`` commits only while the lease still has that epoch: raises ``LeaseLostError``
        now if it has not, and from then on no other holder can take the lease over and
        commit before ``tx`` ends (or, where a takeover cannot be held off, ``tx``'s commit
        is refused). Once refused, ``tx`` commits nothing: leaving its block normally (the
        error caught) rolls it back and raises the error again.

        One cheap statement inside ``tx``, made once per transaction, wherever in it:
        PostgreSQL reads the lease's row ``FOR SHARE`` (a takeover updates that row, so it
        waits for ``tx`` to end; keep fenced transactions well under the lease's ttl, as
        the holder's renewals wait too); SQLite reads it inside ``tx``'s write transaction
        (the file has one writer: no takeover commits in between); memory checks it now and
        again at commit, without I/O. ``tx`` must be a transaction of this store."""


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """What earlier deliveries of one message to one group left on record."""

    failures: int = 0
    """Handler attempts that failed (the next attempt is number ``failures + 1``)."""
    starts: int = 0
    """Redeliveries (deliveries after the first) on which a handler was started."""


@runtime_checkable
class Attempts(Protocol):
    """The attempts of messages that were not handled at their first delivery, kept where
    the next delivery reads them: handler failures count towards ``retry``, redeliveries
    whose handler started count towards ``max_deliveries`` (a crash loop). Nothing is
    written for a message handled at its first delivery."""

    @property
    def durable(self) -> bool:
        """True if records survive the process (a SQL store), so they count across a crash."""

    async def get(self, group: str, message_id: str) -> AttemptRecord:
        """The message's record (an empty one when there is none)."""

    async def started(self, group: str, message_id: str) -> AttemptRecord:
        """Count a redelivery whose handler starts now; return the record as it was."""

    async def failed(self, group: str, message_id: str, error: str) -> None:
        """Count a failed handler attempt."""

    async def clear(self, group: str, message_id: str) -> None:
        """Forget the message (it was handled or dead-lettered)."""


@runtime_checkable
class StoreClock(Protocol):
    """The store's clock, in Unix seconds (a float): the time durable timers are kept in,
    so that instances whose own clocks disagree agree on what is due (DESIGN 5).

    PostgreSQL: the server's clock (``statement_timestamp()``: when the statement began);
    SQLite: the host's clock, which every process on the file shares; memory: the host's
    clock, or the source a test kit puts there (a virtual clock).

    In SQL, use ``sql``: it reads the clock inside the statement that needs it, for no
    round trip of its own (``due = {sql} + $1`` in an insert, ``WHERE due <= {sql}`` in a
    query, ``SELECT min(due) - {sql}`` for the time until the next one).
    """

    @property
    def sql(self) -> str | None:
        """An SQL expression of this clock (Unix seconds, double precision) to put in the
        statements of this store's transactions, the same on every process sharing the
        store; None when its transactions run no SQL (``supports_sql`` False)."""

    async def now(self, tx: Transaction | None = None) -> float:
        """The clock's reading now. PostgreSQL asks the server (one statement, in ``tx``
        when given); SQLite and memory answer without I/O."""


@runtime_checkable
class Store(EventStore, Protocol):
    """A storage backend: the event store plus the dedup table, dead letters, heartbeats,
    checkpoints and outbox, behind one connection pool so they can share transactions."""

    @property
    def url(self) -> str:
        """The URL this store was opened from."""

    @property
    def durable(self) -> bool:
        """True if the data outlives this process and every process that opens ``url``
        sees it (a SQLite file, PostgreSQL); False if it lives in this process only
        (``memory://``, SQLite ``:memory:``), which the command line cannot reach."""

    @property
    def supports_sql(self) -> bool:
        """True if the transactions of ``transaction()`` run SQL (``execute``/``fetch``),
        so a handler's or projection's own tables commit and roll back with eventflow's
        writes. False if they hold only the store's own writes (``memory://``: appends,
        checkpoints, outbox rows, dedup entries; ``execute`` raises
        ``ConfigurationError``), so state kept elsewhere, in Python objects, is not
        rolled back; a projection runner then keeps the effects of the events handled
        before a failure (``ProjectionRunner(atomic_state=...)`` defaults to this)."""

    @property
    def dedup(self) -> DedupStore:
        """The store's dedup table."""

    @property
    def dead_letters(self) -> DeadLetterStore:
        """The store's dead letters."""

    @property
    def heartbeats(self) -> Heartbeats:
        """The store's heartbeat records."""

    @property
    def checkpoints(self) -> Checkpoints:
        """Named positions (projections, relays)."""

    @property
    def outbox(self) -> Outbox:
        """Messages waiting to be relayed to the broker."""

    @property
    def leases(self) -> Leases:
        """Named leases across processes (projection runners, relays)."""

    @property
    def attempts(self) -> Attempts:
        """Attempts of messages not handled at their first delivery."""

    @property
    def clock(self) -> StoreClock:
        """The store's clock, which durable timers are kept in (see :class:`StoreClock`)."""

    def transaction(self) -> AbstractAsyncContextManager[Transaction]:
        """Begin a transaction; commits when the block exits normally, else rolls back."""

    async def mark_handled(
        self, group: str, message_id: str, tx: Transaction, *, cancelled_by: str | None = None
    ) -> None:
        """Record a dedup entry inside ``tx`` (the transactional inbox), visible once ``tx``
        commits; raise ``AlreadyHandled`` if the pair is recorded, here or, in a store that
        sends a transaction's writes with its commit (SQLite), where ``tx`` ends (it rolls
        back then). Two transactions recording one pair never both commit: the later one
        waits for the first to end (PostgreSQL; SQLite: the later to commit) and raises if
        it committed. ``cancelled_by``: the message is recorded as cancelled by that
        compensation (``dedup.cancelled_by``)."""

    async def open(self, supervisor: Supervisor | None = None) -> None:
        """Connect (within the adapter's connect timeout, else a ``StoreError`` naming the
        URL) and create the schema if needed. Background work (the PostgreSQL sequencer)
        runs as components of ``supervisor`` (the app's), or of the store's own when None,
        and is stopped by ``close``. Idempotent."""

    async def close(self) -> None:
        """Disconnect. Idempotent."""


def declared(adapter: object, port: type, member: str) -> Any:
    """``adapter.member``, a member ``port`` declares; a ``ConfigurationError`` saying so
    if the adapter lacks it (one written against an earlier version of the port), instead
    of an ``AttributeError`` from inside a running component."""
    try:
        return getattr(adapter, member)
    except AttributeError:
        raise ConfigurationError(
            f"{type(adapter).__qualname__} lacks {member!r}, which eventflow.ports."
            f"{port.__qualname__} declares: implement it (see the port's docstring)"
        ) from None
