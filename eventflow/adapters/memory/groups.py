"""The memory broker's consumer groups: groups, partitions, members and deliveries.

A *hub* holds the groups of every broker opened with one ``memory://NAME``. A group spreads
its messages over partitions (by key hash; keyless messages round-robin); each partition is
*assigned* to one live member and *owned* by the member whose deliveries of it are out. A
partition changes owner only once its in-flight messages are settled, so one key is never
handled by two members at once. A record stays a plain tuple until a member takes it; then
it becomes a :class:`MemoryDelivery`, and a redelivery is a fresh copy of it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import BrokerError

__all__ = [
    "Group",
    "MemoryDelivery",
    "MemorySubscription",
    "Partition",
    "Record",
]

_EMPTY: Mapping[str, str] = {}
_alloc = object.__new__

Record = tuple[str, bytes, str | None, Mapping[str, str] | None, float]
"""A message not yet taken by a member: topic, payload, key, headers (None: none) and
its publish time (``time.time()``)."""


class Partition:
    """One partition of a group: its records never delivered, those to deliver again and
    those out; the member it is assigned to and the member that owns it now."""

    __slots__ = ("assigned", "index", "inflight", "next_offset", "owner", "pending", "retry")

    def __init__(self, index: int) -> None:
        self.index = index
        # Records never delivered, in publish order, as tuples of plain values (topic,
        # payload, key, headers or None, publish time): the garbage collector untracks such
        # tuples (those without headers), so a long backlog is not traversed and promoted
        # by every collection. A record gets its offset in the partition when first taken.
        self.pending: deque[Record] = deque()
        self.next_offset = 0
        # Records to deliver again (nacked, released, or out to a member that left), in
        # offset order. Each was delivered before anything in `pending`, so all go first.
        self.retry: deque[MemoryDelivery] = deque()
        # offset -> the delivery now out for it: a superseded delivery is not in here.
        self.inflight: dict[int, MemoryDelivery] = {}
        self.owner: MemorySubscription | None = None
        self.assigned: MemorySubscription | None = None

    def wake(self) -> None:
        """Wake the member that can take this partition's next record."""
        member = self.owner or self.assigned
        if member is not None:
            member.wakeup.set()

    def requeue(self, records: list[MemoryDelivery]) -> None:
        """Put records back in offset order ahead of everything not yet delivered."""
        self.retry = deque(sorted([*records, *self.retry], key=lambda r: r.offset))

    def oldest(self) -> float | None:
        """The publish time of this partition's oldest record not acked, if any: one out
        or to deliver again (each taken before anything still pending), else the first
        pending one."""
        taken = [d.published for d in self.inflight.values()]
        if self.retry:
            taken.append(self.retry[0].published)  # retry is in offset (publish) order
        if taken:
            return min(taken)
        return self.pending[0][4] if self.pending else None


class Group:
    """A durable consumer group on one pattern: its partitions, live members and the
    number of unacked messages (bounded by ``capacity``, which publishers wait for)."""

    __slots__ = (
        "capacity",
        "drop",
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
        self.partitions = [Partition(i) for i in range(partitions)]
        self.members: list[MemorySubscription] = []
        self.capacity = capacity
        # Waiting publishers resume only once the group has drained below this mark, so a
        # full group wakes them once per batch rather than once per ack.
        self.low_water = capacity - max(1, capacity // 8)
        self.size = 0
        self.space = asyncio.Event()
        self.space.set()
        self.rr = itertools.cycle(range(partitions))
        # A temporary group's removal from its hub, called when its last member leaves.
        self.drop: Callable[[], None] | None = None

    def put(
        self,
        topic: str,
        payload: bytes,
        key: str | None,
        headers: Mapping[str, str] | None,
        published: float,
    ) -> None:
        """Queue a message on its key's partition (the next one in turn without a key);
        ``published`` is its publish time (``time.time()``)."""
        parts = self.partitions
        part = parts[hash(key) % len(parts)] if key is not None else parts[next(self.rr)]
        part.pending.append((topic, payload, key, headers, published))
        self.size += 1
        if self.size >= self.capacity:
            self.space.clear()
        member = part.owner or part.assigned
        # Only a member waiting in fetch() needs the wake-up (an attribute test instead of
        # a call to Event.is_set per message).
        if member is not None and member.idle:
            member.wakeup.set()

    def oldest(self) -> float | None:
        """The publish time of the group's oldest message not acked (None: none)."""
        times = [t for part in self.partitions if (t := part.oldest()) is not None]
        return min(times) if times else None

    def rebalance(self) -> None:
        """Assign the partitions over the live members again, after one joined or left."""
        members = self.members
        for i, part in enumerate(self.partitions):
            part.assigned = members[i % len(members)] if members else None
            if part.owner is not None and (
                part.owner not in members or (part.owner is not part.assigned and not part.inflight)
            ):
                part.owner = None  # wake-ups go to the member the partition is assigned to
            if part.assigned is not None and (part.pending or part.retry):
                part.assigned.wakeup.set()


class MemoryDelivery:
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
        "published",
        "topic",
    )

    _group: Group
    _part: Partition
    offset: int
    topic: str
    payload: bytes
    key: str | None
    headers: Mapping[str, str]
    delivery_count: int  # deliveries so far; _take counts this one
    not_before: float  # loop time before which a nacked one is not redelivered
    published: float  # when publish took the message (time.time()), for Broker.lag

    def _again(self, delivery_count: int, not_before: float) -> MemoryDelivery:
        """The record of this message's next delivery."""
        return new_delivery(
            self._group,
            self._part,
            self.offset,
            self.topic,
            self.payload,
            self.key,
            self.headers,
            delivery_count,
            not_before,
            self.published,
        )

    @property
    def metadata(self) -> Mapping[str, Any]:
        """``{"partition": int, "offset": int}``, as in Kafka."""
        return {"partition": self._part.index, "offset": self.offset}

    async def ack(self) -> None:
        """Settle the message; the last settlement hands a moving partition over."""
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
        """Redeliver after ``delay`` seconds; the later messages of its key wait for it (the
        partition's other keys do not)."""
        if delay > 0:
            loop = asyncio.get_running_loop()
            if self._give_back(self.delivery_count, loop.time() + delay):
                # Wake whoever holds the partition when the delay ends: the member that
                # nacked may have left, and its successor may be waiting in fetch().
                loop.call_later(delay, self._part.wake)
        else:
            self._give_back(self.delivery_count, 0.0)

    async def release(self) -> None:
        """Give the message back uncounted (no handler saw it)."""
        # Not counted as an attempt; only the current, unsettled delivery can be released
        # (a second call is a no-op).
        self._give_back(self.delivery_count - 1, 0.0)

    def _give_back(self, delivery_count: int, not_before: float) -> bool:
        """Return the message to the head of its partition (offset order), ahead of later
        messages of its key, which therefore wait for it (``_take_around``)."""
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
        """Nothing to do: the memory broker has no delivery deadline."""
        return None


def new_delivery(
    group: Group,
    part: Partition,
    offset: int,
    topic: str,
    payload: bytes,
    key: str | None,
    headers: Mapping[str, str],
    delivery_count: int,
    not_before: float,
    published: float,
) -> MemoryDelivery:
    """A delivery, made when a member takes a record (once per message and group). A
    function, not ``__init__``: calling a class runs its ``__init__`` through a slower
    nested call, once per message."""
    delivery = _alloc(MemoryDelivery)
    delivery._group = group
    delivery._part = part
    delivery.offset = offset
    delivery.topic = topic
    delivery.payload = payload
    delivery.key = key
    delivery.headers = headers
    delivery.delivery_count = delivery_count
    delivery.not_before = not_before
    delivery.published = published
    return delivery


class MemorySubscription:
    """A live member of a group (see :class:`eventflow.ports.Subscription`); ``owners`` is
    the set of its broker's subscriptions, which it leaves when it closes."""

    def __init__(self, group: Group, owners: set[MemorySubscription]) -> None:
        self.pattern = group.pattern
        self.group = group.name
        self._group = group
        self._owners = owners
        self.wakeup = asyncio.Event()
        self.idle = 0  # fetch() calls waiting for wakeup
        self.closed = False
        self._now = asyncio.get_running_loop().time

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[MemoryDelivery]:
        """Return 1..max_messages deliveries, or none after ``timeout`` seconds."""
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

    def _take(self, limit: int) -> list[MemoryDelivery]:
        out: list[MemoryDelivery] = []
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
            waiting = False
            while retry and len(out) < limit:
                delivery = retry[0]
                if delivery.not_before and delivery.not_before > self._now():
                    waiting = True
                    break
                retry.popleft()
                delivery.delivery_count += 1
                inflight[delivery.offset] = delivery
                out.append(delivery)
            if waiting:
                # A nacked record waits out its delay, and so do the later records of its
                # key; the partition's other keys go on.
                self._take_around(part, out, limit)
                if len(out) >= limit:
                    break
                continue
            if retry:
                if len(out) >= limit:
                    break
                continue
            offset = part.next_offset
            for _ in range(min(limit - len(out), len(pending))):
                topic, payload, key, headers, published = pending.popleft()
                delivery = new_delivery(
                    group, part, offset, topic, payload, key, headers or _EMPTY, 1, 0.0, published
                )
                inflight[offset] = delivery
                out.append(delivery)
                offset += 1
            part.next_offset = offset
            if len(out) >= limit:
                break
        return out

    def _take_around(self, part: Partition, out: list[MemoryDelivery], limit: int) -> None:
        """Take from ``part`` into ``out`` (up to ``limit``) past records that wait out a
        nack's delay: a waiting record holds back the later records of its key (a keyless
        one holds back nothing), every other record is taken in offset order. Pending
        records of a held-back key move to the retry queue (given their offsets, in order),
        so the next take skips them at the cost of a look, not of a rescan of the backlog."""
        now = self._now()
        held: set[str] = set()
        kept: deque[MemoryDelivery] = deque()
        retry, inflight = part.retry, part.inflight
        while retry:
            delivery = retry.popleft()
            key = delivery.key
            waiting = delivery.not_before and delivery.not_before > now
            if len(out) >= limit or waiting or (key is not None and key in held):
                if waiting and key is not None:
                    held.add(key)
                kept.append(delivery)
                continue
            delivery.delivery_count += 1
            inflight[delivery.offset] = delivery
            out.append(delivery)
        pending, group = part.pending, self._group
        offset = part.next_offset
        while pending and len(out) < limit:
            topic, payload, key, headers, published = pending.popleft()
            record = new_delivery(
                group, part, offset, topic, payload, key, headers or _EMPTY, 0, 0.0, published
            )
            offset += 1
            if key is not None and key in held:
                kept.append(record)  # offsets grow: the retry queue stays in offset order
                continue
            record.delivery_count = 1
            inflight[record.offset] = record
            out.append(record)
        part.next_offset = offset
        part.retry = kept

    async def close(self) -> None:
        """Leave the group: unacked messages are redelivered to the other members."""
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
        if group.drop is not None and not group.members:
            group.drop()
        group.rebalance()
        self.wakeup.set()
