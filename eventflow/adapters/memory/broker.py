"""The in-memory broker: partitioned consumer groups with acks, redelivery and backpressure.

Brokers opened with the same ``memory://NAME`` in one process share a hub (``memory://``
is the default hub), so several apps in one process talk to each other. A hub lives while
a broker using it is open.

Each (group, pattern) pair is a durable consumer group created by its first ``subscribe``.
Its messages are spread over ``partitions`` by key hash (keyless messages round-robin), and
partitions are shared among the group's live members. A partition changes owner only once
its in-flight messages are settled, so one key is never handled by two members at once.
Messages not acked when a member leaves go back to the front of their partition. A
delivery's ``metadata`` is its partition and its offset in that partition, as in Kafka.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ...errors import BackpressureError, BrokerError, ConfigurationError, MessageRefusedError
from ...patterns import matches, validate_pattern, validate_topic
from ...urls import count_option, seconds_option, url_options

if TYPE_CHECKING:
    from ...supervision import Supervisor

__all__ = ["MemoryBroker", "MemoryBrokerConfig"]

DEFAULT_PARTITIONS = 8
DEFAULT_MAX_PENDING = 10_000
DEFAULT_PUBLISH_TIMEOUT = 5.0
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
_MAX_ROUTES = 4096  # topics whose target groups a hub remembers (then it starts over)
_SPACE_POLL = 0.05
_EMPTY: Mapping[str, str] = {}
_URL_OPTIONS = ("partitions", "max_pending", "publish_timeout", "max_message_bytes")
_alloc = object.__new__


@dataclass(frozen=True, slots=True)
class MemoryBrokerConfig:
    """Settings of a memory broker.

    ``max_pending`` bounds each group's unacked messages (queued plus in flight); a publisher
    finding a group full waits up to ``publish_timeout`` seconds, then gets
    ``BackpressureError``. A payload over ``max_message_bytes`` (1 MiB, as NATS's and
    Kafka's defaults, so code tried here meets the same limit there) is refused with
    ``MessageRefusedError``.
    """

    name: str = ""
    partitions: int = DEFAULT_PARTITIONS
    max_pending: int = DEFAULT_MAX_PENDING
    publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


class _Partition:
    __slots__ = ("assigned", "index", "inflight", "next_offset", "owner", "pending", "retry")

    def __init__(self, index: int) -> None:
        self.index = index
        # Records never delivered, in publish order, as tuples of plain values (topic,
        # payload, key, headers or None): the garbage collector untracks such tuples (those
        # without headers), so a long backlog is not traversed and promoted by every
        # collection. A record gets its offset in the partition when it is first taken.
        self.pending: deque[tuple[str, bytes, str | None, Mapping[str, str] | None]] = deque()
        self.next_offset = 0
        # Records to deliver again (nacked, released, or out to a member that left), in
        # offset order. Each was delivered before anything in `pending`, so all go first.
        self.retry: deque[_MemoryDelivery] = deque()
        # offset -> the delivery now out for it: a superseded delivery is not in here.
        self.inflight: dict[int, _MemoryDelivery] = {}
        self.owner: _MemorySubscription | None = None
        self.assigned: _MemorySubscription | None = None

    def wake(self) -> None:
        """Wake the member that can take this partition's next record."""
        member = self.owner or self.assigned
        if member is not None:
            member.wakeup.set()

    def requeue(self, records: list[_MemoryDelivery]) -> None:
        """Put records back in offset order ahead of everything not yet delivered."""
        self.retry = deque(sorted([*records, *self.retry], key=lambda r: r.offset))


class _Group:
    __slots__ = (
        "capacity",
        "low_water",
        "members",
        "name",
        "partitions",
        "pattern",
        "rr",
        "size",
        "space",
    )

    def __init__(self, name: str, pattern: str, partitions: int, capacity: int) -> None:
        self.name = name
        self.pattern = pattern
        self.partitions = [_Partition(i) for i in range(partitions)]
        self.members: list[_MemorySubscription] = []
        self.capacity = capacity
        # Waiting publishers resume only once the group has drained below this mark, so a
        # full group wakes them once per batch rather than once per ack.
        self.low_water = capacity - max(1, capacity // 8)
        self.size = 0
        self.space = asyncio.Event()
        self.space.set()
        self.rr = itertools.cycle(range(partitions))

    def put(
        self, topic: str, payload: bytes, key: str | None, headers: Mapping[str, str] | None
    ) -> None:
        parts = self.partitions
        part = parts[hash(key) % len(parts)] if key is not None else parts[next(self.rr)]
        part.pending.append((topic, payload, key, headers))
        self.size += 1
        if self.size >= self.capacity:
            self.space.clear()
        member = part.owner or part.assigned
        # Only a member waiting in fetch() needs the wake-up (an attribute test instead of
        # a call to Event.is_set per message).
        if member is not None and member.idle:
            member.wakeup.set()

    def rebalance(self) -> None:
        members = self.members
        for i, part in enumerate(self.partitions):
            part.assigned = members[i % len(members)] if members else None
            if part.owner is not None and (
                part.owner not in members or (part.owner is not part.assigned and not part.inflight)
            ):
                part.owner = None  # wake-ups go to the member the partition is assigned to
            if part.assigned is not None and (part.pending or part.retry):
                part.assigned.wakeup.set()


class _Hub:
    def __init__(self, config: MemoryBrokerConfig) -> None:
        self.config = config
        self.groups: dict[tuple[str, str], _Group] = {}
        self.routes: dict[str, list[_Group]] = {}
        self.refs = 0

    def route(self, topic: str) -> list[_Group]:
        routes = self.routes
        groups = routes.get(topic)
        if groups is None:
            groups = [g for g in self.groups.values() if matches(g.pattern, topic)]
            if len(routes) >= _MAX_ROUTES:
                routes.clear()  # topics made per id must not grow the hub without end
            routes[topic] = groups
        return groups


_hubs: dict[str, _Hub] = {}


class _MemoryDelivery:
    """One delivery of a message: made when a member takes the record (a plain tuple until
    then), and while queued for redelivery the record itself.

    Redelivering makes a fresh copy (``_again``): a superseded delivery (nacked, released,
    or out to a member that left) is no longer its partition's in-flight entry, so it
    cannot settle the copy.
    """

    __slots__ = (
        "_group",
        "_part",
        "delivery_count",
        "headers",
        "key",
        "not_before",
        "offset",
        "payload",
        "topic",
    )

    _group: _Group
    _part: _Partition
    offset: int
    topic: str
    payload: bytes
    key: str | None
    headers: Mapping[str, str]
    delivery_count: int  # deliveries so far; _take counts this one
    not_before: float  # loop time before which a nacked one is not redelivered

    def _again(self, delivery_count: int, not_before: float) -> _MemoryDelivery:
        """The record of this message's next delivery."""
        return _new_delivery(
            self._group,
            self._part,
            self.offset,
            self.topic,
            self.payload,
            self.key,
            self.headers,
            delivery_count,
            not_before,
        )

    @property
    def metadata(self) -> Mapping[str, Any]:
        return {"partition": self._part.index, "offset": self.offset}

    async def ack(self) -> None:
        part = self._part
        inflight = part.inflight
        # A delivery superseded by a redelivery (its member left) no longer owns the record.
        if inflight.get(self.offset) is not self:
            return
        del inflight[self.offset]
        group = self._group
        size = group.size = group.size - 1
        if size <= group.low_water and not group.space.is_set():
            group.space.set()
        if not inflight and part.owner is not part.assigned:
            part.owner = None
            if part.assigned is not None:
                part.assigned.wakeup.set()

    async def nack(self, delay: float = 0.0) -> None:
        if delay > 0:
            loop = asyncio.get_running_loop()
            if self._give_back(self.delivery_count, loop.time() + delay):
                # Wake whoever holds the partition when the delay ends: the member that
                # nacked may have left, and its successor may be waiting in fetch().
                loop.call_later(delay, self._part.wake)
        else:
            self._give_back(self.delivery_count, 0.0)

    async def release(self) -> None:
        # Not counted as an attempt; only the current, unsettled delivery can be released
        # (a second call is a no-op).
        self._give_back(self.delivery_count - 1, 0.0)

    def _give_back(self, delivery_count: int, not_before: float) -> bool:
        """Return the message to the head of its partition (offset order), ahead of later
        messages of its key, which therefore wait for it."""
        part = self._part
        if part.inflight.get(self.offset) is not self:
            return False
        del part.inflight[self.offset]
        part.requeue([self._again(delivery_count, not_before)])
        if not part.inflight and part.owner is not part.assigned:
            part.owner = None
        part.wake()
        return True

    async def in_progress(self) -> None:
        return None


def _new_delivery(
    group: _Group,
    part: _Partition,
    offset: int,
    topic: str,
    payload: bytes,
    key: str | None,
    headers: Mapping[str, str],
    delivery_count: int,
    not_before: float,
) -> _MemoryDelivery:
    """A delivery, made when a member takes a record (once per message and group). A
    function, not ``__init__``: calling a class runs its ``__init__`` through a slower
    nested call, once per message."""
    delivery = _alloc(_MemoryDelivery)
    delivery._group = group
    delivery._part = part
    delivery.offset = offset
    delivery.topic = topic
    delivery.payload = payload
    delivery.key = key
    delivery.headers = headers
    delivery.delivery_count = delivery_count
    delivery.not_before = not_before
    return delivery


class _MemorySubscription:
    def __init__(self, group: _Group, owners: set[_MemorySubscription]) -> None:
        self.pattern = group.pattern
        self.group = group.name
        self._group = group
        self._owners = owners
        self.wakeup = asyncio.Event()
        self.idle = 0  # fetch() calls waiting for wakeup
        self.closed = False
        self._now = asyncio.get_running_loop().time

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[_MemoryDelivery]:
        if self.closed:
            raise BrokerError("fetch on a closed subscription; subscribe again")
        out = self._take(max_messages)
        if out or timeout <= 0:
            return out
        deadline = self._now() + timeout
        while True:
            self.wakeup.clear()
            out = self._take(max_messages)
            remaining = deadline - self._now()
            if out or remaining <= 0 or self.closed:
                return out
            self.idle += 1
            try:
                async with asyncio.timeout(remaining):
                    await self.wakeup.wait()  # a wake-up may find nothing (another took it)
            except TimeoutError:
                return [] if self.closed else self._take(max_messages)
            finally:
                self.idle -= 1

    def _take(self, limit: int) -> list[_MemoryDelivery]:
        out: list[_MemoryDelivery] = []
        group = self._group
        for part in group.partitions:
            pending, retry = part.pending, part.retry
            if part.assigned is not self or not (pending or retry):
                continue
            if part.owner is not self:
                if part.inflight:
                    continue  # the previous owner is still settling this partition
                part.owner = self
            inflight = part.inflight
            while retry and len(out) < limit:
                delivery = retry[0]
                if delivery.not_before and delivery.not_before > self._now():
                    break  # a nacked record waits out its delay; its partition waits too
                retry.popleft()
                delivery.delivery_count += 1
                inflight[delivery.offset] = delivery
                out.append(delivery)
            if retry:
                if len(out) >= limit:
                    break
                continue
            offset = part.next_offset
            for _ in range(min(limit - len(out), len(pending))):
                topic, payload, key, headers = pending.popleft()
                delivery = _new_delivery(
                    group, part, offset, topic, payload, key, headers or _EMPTY, 1, 0.0
                )
                inflight[offset] = delivery
                out.append(delivery)
                offset += 1
            part.next_offset = offset
            if len(out) >= limit:
                break
        return out

    async def close(self) -> None:
        self.abandon()

    def abandon(self) -> None:
        """Leave at once as if the process died: unacked messages are redelivered."""
        if self.closed:
            return
        self.closed = True
        self._owners.discard(self)
        group = self._group
        for part in group.partitions:
            if part.owner is self:
                if part.inflight:
                    part.requeue([d._again(d.delivery_count, 0.0) for d in part.inflight.values()])
                    part.inflight.clear()
                part.owner = None
        if self in group.members:
            group.members.remove(self)
        group.rebalance()
        self.wakeup.set()


class MemoryBroker:
    """A real in-process broker with the semantics of the :class:`~eventflow.ports.Broker` port.

    ``MemoryBroker()`` joins the default hub; ``MemoryBroker(MemoryBrokerConfig(name="x"))``
    (or ``open_broker("memory://x")``) joins hub ``x``.
    """

    def __init__(self, config: MemoryBrokerConfig | None = None) -> None:
        self.config = config or MemoryBrokerConfig()
        cfg = self.config
        if cfg.partitions < 1 or cfg.max_pending < 1 or cfg.max_message_bytes < 1:
            raise ConfigurationError(
                "memory broker partitions, max_pending and max_message_bytes must be >= 1"
            )
        self._hub: _Hub | None = None
        self._subs: set[_MemorySubscription] = set()
        self._max_bytes = cfg.max_message_bytes

    @classmethod
    def from_url(cls, url: str) -> MemoryBroker:
        """``memory://[hub][?option=value&...]``, options ``partitions``, ``max_pending``,
        ``publish_timeout`` and ``max_message_bytes`` (as in :class:`MemoryBrokerConfig`):
        brokers opened with one hub name share its groups; an unknown option is refused."""
        parts = urlsplit(url)
        options = url_options(url, _URL_OPTIONS, kind="memory broker")
        defaults = MemoryBrokerConfig()
        return cls(
            MemoryBrokerConfig(
                name=parts.netloc + parts.path,
                partitions=count_option(url, options, "partitions", defaults.partitions),
                max_pending=count_option(url, options, "max_pending", defaults.max_pending),
                publish_timeout=seconds_option(
                    url, options, "publish_timeout", defaults.publish_timeout
                ),
                max_message_bytes=count_option(
                    url, options, "max_message_bytes", defaults.max_message_bytes
                ),
            )
        )

    @property
    def url(self) -> str:
        """The URL that opens a broker on the same hub."""
        return f"memory://{self.config.name}"

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Attach to the hub. Idempotent."""
        if self._hub is not None:
            return
        hub = _hubs.get(self.config.name)
        if hub is None:
            hub = _hubs[self.config.name] = _Hub(self.config)
        hub.refs += 1
        self._hub = hub

    async def close(self) -> None:
        """Close this broker's subscriptions and detach; the hub goes with its last broker."""
        hub = self._hub
        if hub is None:
            return
        for sub in list(self._subs):
            sub.abandon()
        self._subs.clear()
        self._hub = None
        hub.refs -= 1
        if hub.refs <= 0 and _hubs.get(self.config.name) is hub:
            del _hubs[self.config.name]

    async def __aenter__(self) -> MemoryBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _live_hub(self) -> _Hub:
        if self._hub is None:
            raise BrokerError("memory broker is not started: call `await broker.start()` first")
        return self._hub

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Hand ``payload`` to every group whose pattern matches ``topic``.

        Waits while a target group is full, up to ``publish_timeout``.
        """
        hub = self._hub
        if hub is None:
            raise BrokerError("memory broker is not started: call `await broker.start()` first")
        if len(payload) > self._max_bytes:
            raise MessageRefusedError(
                f"memory broker refuses the message for {topic!r}: {len(payload)} bytes, over "
                f"max_message_bytes={self._max_bytes}; it is not retried: make "
                "it smaller (NATS and Kafka refuse it too by default)"
            )
        groups = hub.routes.get(topic)
        if groups is None:
            validate_topic(topic)
            groups = hub.route(topic)
        hdrs = dict(headers) if headers else None
        for group in groups:
            if group.size >= group.capacity:
                # All or nothing: wait until every target group has room, then hand the
                # message to all of them at once, so a BackpressureError leaves none with it.
                await self._wait_space(groups, topic)
                break
        for group in groups:
            group.put(topic, payload, key, hdrs)

    async def _wait_space(self, groups: Sequence[_Group], topic: str) -> None:
        """Wait until none of ``groups`` is full, up to ``publish_timeout`` in all."""
        # Woken at the low-water mark (one wake-up per batch of acks), or after a short
        # poll, so a group with a little room left by a slow consumer lets the publisher on.
        timeout = self.config.publish_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            full = next((g for g in groups if g.size >= g.capacity), None)
            if full is None:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(min(remaining, _SPACE_POLL)):
                    await full.space.wait()
            except TimeoutError:
                pass
        raise BackpressureError(
            f"group {full.name!r} ({full.pattern}) has {full.size} unacked messages "
            f"(max_pending={full.capacity}): publishing to {topic!r} found no moment within "
            f"{timeout}s when all its groups had room, so no group got the message; add "
            "consumers or slow the producer"
        )

    async def subscribe(self, pattern: str, *, group: str) -> _MemorySubscription:
        """Join ``group`` on ``pattern``; returns once the membership is live."""
        hub = self._live_hub()
        validate_pattern(pattern)
        if not group:
            raise ConfigurationError("a consumer group name must be non-empty")
        state = hub.groups.get((group, pattern))
        if state is None:
            cfg = self.config
            state = hub.groups[(group, pattern)] = _Group(
                group, pattern, cfg.partitions, cfg.max_pending
            )
            hub.routes.clear()
        sub = _MemorySubscription(state, self._subs)
        state.members.append(sub)
        state.rebalance()
        self._subs.add(sub)
        return sub

    def group_sizes(self) -> dict[tuple[str, str], int]:
        """Unacked messages per (group, pattern): the lag of each group, for status and tests."""
        hub = self._live_hub()
        return {k: g.size for k, g in hub.groups.items()}
