"""Per-partition bookkeeping of a Kafka membership and its deliveries.

A partition keeps the records fetched but not handed out (``queue``, in offset order) and
those handed out but not settled (``inflight``); ``nack``/``release`` put a record back at
the head of its queue. A record nacked with a delay waits there, holding back the later
records of its key only: the partition's other keys are handed out past it (its offset is
not committed until it is finished, so a new owner gets it again).
It counts the deliveries of its records itself (Kafka has no such
count) and knows what to commit: its first unfinished offset and the companion value below.
What its member needs to hear (records buffered, a commit due, a fetch to wake) goes
through the :class:`MemberState` the member gives it; a partition knows nothing else of
the member.

Delivery counts carried to the next owner: with each commit of the group's first unfinished
offset (the *head*), the member commits a value in a companion consumer group that packs, in
one int64 "offset", how many offsets past the head were handed out (the *span*, 16 bits) and
how often the head was delivered (the *count*, 8 bits), both saturating, and the head's low
39 bits as a *check* (63 bits in all, so any value is a valid offset; the sign bit stays 0).
Both include what earlier members delivered, as far as the member learnt it: a member that
committed only its own deliveries would erase, at its first commit, what the one before it
had handed out, and after its crash the next owner would count those again from 1.

The full head is not stored: it is the group's own committed offset, committed just before
(:func:`_unpack` takes it). Only the main commit can succeed without the companion's (a
crash, or a failure in between), so the companion value is the head's or an older head's:
the *stale* head is the largest offset not above the main offset whose low bits are the
check, exact while the main offset moved less than 2**39 past it. A stale value still says
something true: the offsets from the main offset to the old head plus its span were
delivered once before; the old head's count concerns a finished offset and is unused.

Values written before this encoding (``head << 24 | span << 8 | count``) are the same bits:
they could only be committed for heads below 2**39 (larger ones overflowed int64 and failed),
where the check is the head itself, so they are read as they were meant. A companion value
ahead of the main offset (someone reset the group's offsets backwards) cannot be told from a
stale one; it is read as a stale one, which only claims deliveries for offsets that were
indeed delivered before the reset, or, when no such head exists, ignored.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["KafkaDelivery", "MemberState", "Partition", "attempts_group"]

_EMPTY: Mapping[str, str] = {}
_SPAN_BITS, _COUNT_BITS, _CHECK_BITS = 16, 8, 39
_SPAN_MAX, _COUNT_MAX = (1 << _SPAN_BITS) - 1, (1 << _COUNT_BITS) - 1
_CHECK_MOD = 1 << _CHECK_BITS
_LOW_BITS = _SPAN_BITS + _COUNT_BITS


def attempts_group(group: str) -> str:
    """The companion group that carries delivery counts of ``group`` between members."""
    return f"__eventflow_attempts.{group}"


def _pack(head: int, span: int, count: int) -> int:
    """The companion value of (head, span, count): below 2**63 for any head Kafka has."""
    return (
        (head % _CHECK_MOD) << _LOW_BITS
        | min(span, _SPAN_MAX) << _COUNT_BITS
        | min(count, _COUNT_MAX)
    )


def _unpack(value: int, done: int) -> tuple[int, int, int] | None:
    """(head, span, count) of a companion ``value`` read with the group's committed offset
    ``done``: the head is ``done`` or the latest offset before it with the value's check;
    None when no such offset exists (the value cannot belong to this position)."""
    check = (value >> _LOW_BITS) % _CHECK_MOD
    head = done - (done - check) % _CHECK_MOD
    if head < 0:
        return None
    return head, (value >> _COUNT_BITS) & _SPAN_MAX, value & _COUNT_MAX


class MemberState:
    """What the partitions of one member share with it: the number of records queued in
    all of them (bounded by ``max_buffer``), whether anything changed since the last commit,
    and the event a waiting ``fetch`` sleeps on. The member owns it; its partitions and
    deliveries update it."""

    __slots__ = ("buffered", "dirty", "wakeup")

    def __init__(self) -> None:
        self.buffered = 0
        self.dirty = False
        self.wakeup = asyncio.Event()

    def wake(self) -> None:
        """Wake a waiting ``fetch``: records became available (or the member changed)."""
        self.wakeup.set()


class Partition:
    """What one member knows about one assigned partition: its records, its position and
    its delivery counts."""

    __slots__ = (
        "active",
        "committed",
        "handed_hi",
        "inflight",
        "member",
        "next_offset",
        "prior_count",
        "prior_head",
        "prior_hi",
        "prior_lo",
        "queue",
        "start",
        "tp",
    )

    def __init__(self, tp: Any, member: MemberState) -> None:
        self.tp = tp
        self.member = member
        self.queue: deque[KafkaDelivery] = deque()
        self.inflight: dict[int, KafkaDelivery] = {}
        self.active = False
        self.start: int | None = None  # the position the member started from
        self.next_offset: int | None = None  # the offset after the last record fetched
        self.handed_hi = -1  # one past the highest offset handed out
        self.committed: tuple[int, int] | None = None  # last (offset, companion) committed
        # From the companion group: offsets in [prior_lo, prior_hi) were delivered before,
        # prior_head `prior_count` times.
        self.prior_lo = self.prior_hi = self.prior_head = -1
        self.prior_count = 0

    # -- records -----------------------------------------------------------------------------

    def file(self, records: Iterable[Any], topic: str) -> int:
        """Queue the fetched ``records`` (aiokafka's, in offset order) of eventflow topic
        ``topic``; returns how many were new (a refetch after a seek repeats some)."""
        queue = self.queue
        floor = self.next_offset if self.next_offset is not None else -1
        filed = 0
        last = None
        for rec in records:
            last = rec.offset
            if last < floor:
                continue  # already queued or handed out (refetch after a seek)
            key = rec.key
            hdrs = rec.headers
            queue.append(
                KafkaDelivery(
                    self,
                    last,
                    topic,
                    rec.value if rec.value is not None else b"",
                    key.decode("utf-8", "replace") if key is not None else None,
                    {k: v.decode("utf-8", "replace") for k, v in hdrs} if hdrs else _EMPTY,
                    0,
                )
            )
            filed += 1
        if last is not None:
            self.next_offset = last + 1
        self.member.buffered += filed
        return filed

    def take(self, out: list[KafkaDelivery], limit: int, clock: Callable[[], float]) -> None:
        """Hand out queued records into ``out`` until it holds ``limit``, counting each
        delivery. A nacked record still waiting out its delay holds back the later records
        of its key (:meth:`_take_around`); the partition's other keys go on."""
        queue = self.queue
        taken = 0
        now = 0.0
        while queue and len(out) < limit:
            item = queue[0]
            if item.not_before:
                now = now or clock()
                if item.not_before > now:
                    taken += self._take_around(out, limit, now)
                    break
                item.not_before = 0.0
            queue.popleft()
            taken += 1
            self._hand_out(item, out)
        if taken:
            member = self.member
            member.buffered -= taken
            member.dirty = True

    def _hand_out(self, item: KafkaDelivery, out: list[KafkaDelivery]) -> None:
        offset = item.offset
        if offset < self.prior_hi or offset == self.prior_head:
            item.delivery_count = max(item.delivery_count, self.prior(offset))
        item.delivery_count += 1
        self.inflight[offset] = item
        out.append(item)
        if offset >= self.handed_hi:
            self.handed_hi = offset + 1

    def _take_around(self, out: list[KafkaDelivery], limit: int, now: float) -> int:
        """Hand out queued records past those waiting out a nack's delay: a waiting record
        holds back the later records of its key (a keyless one holds back nothing); the
        rest go in offset order. The commit position stays at the first record not
        finished, so a waiting record is redelivered to the next owner if the partition
        moves. Returns how many were handed out."""
        held: set[str] = set()
        kept: deque[KafkaDelivery] = deque()
        taken = 0
        for item in self.queue:
            key = item.key
            waiting = item.not_before > now
            if len(out) >= limit or waiting or (key is not None and key in held):
                if waiting and key is not None:
                    held.add(key)
                kept.append(item)
                continue
            item.not_before = 0.0
            taken += 1
            self._hand_out(item, out)
        self.queue = kept
        return taken

    def give_back(self, item: KafkaDelivery) -> None:
        """Queue ``item`` again in offset order (normally at the head)."""
        queue = self.queue
        if not queue or queue[0].offset > item.offset:
            queue.appendleft(item)
        else:
            merged = sorted([item, *queue], key=lambda d: d.offset)
            queue.clear()
            queue.extend(merged)
        self.member.buffered += 1

    def drop(self) -> None:
        """Forget the partition: queued records go, in-flight deliveries become stale."""
        self.member.buffered -= len(self.queue)
        self.queue.clear()
        self.inflight.clear()
        self.active = False

    # -- positions ---------------------------------------------------------------------------

    def start_from(self, done: int, value: int | None, *, refetch: bool) -> None:
        """Start from the group's committed offset ``done`` with the companion ``value``
        committed next to it. ``refetch``: the consumer was moved to ``done``, so what is
        queued will be fetched again; else only records below ``done`` (finished) go."""
        queue = self.queue
        if refetch:
            self.member.buffered -= len(queue)
            queue.clear()
            self.next_offset = None
        else:
            kept = [d for d in queue if d.offset >= done]
            self.member.buffered -= len(queue) - len(kept)
            self.queue = deque(kept)
        self.start = done
        self.set_prior(done, value)

    def resume_position(self) -> int | None:
        """Where fetching carries on when the partition comes back to this member."""
        return self.next_offset if self.next_offset is not None else self.start

    def position(self) -> int | None:
        """The first offset not finished: what a commit records."""
        pos = self.next_offset if self.next_offset is not None else self.start
        if pos is None:
            return None
        if self.queue and self.queue[0].offset < pos:
            pos = self.queue[0].offset
        if self.inflight:
            low = min(self.inflight)
            if low < pos:
                pos = low
        return pos

    def to_commit(self) -> tuple[int, int] | None:
        """(offset, companion value) to commit now, or None when there is nothing new: the
        first unfinished offset, and the counts packed as the module docstring says."""
        pos = self.position()
        if pos is None:
            return None
        # The span covers what earlier members delivered too, until it is finished: a value
        # that only covered this member's deliveries would make the next owner take them
        # for first deliveries.
        span = max(0, max(self.handed_hi, self.prior_hi) - pos)
        value = _pack(pos, span, self.head_count(pos) if span else 0)
        if self.committed == (pos, value):
            return None
        return pos, value

    # -- delivery counts ---------------------------------------------------------------------

    def set_prior(self, done: int, value: int | None) -> None:
        """Take what earlier members knew from the companion ``value`` committed with the
        group's offset ``done`` (see the module docstring)."""
        self.prior_lo = self.prior_hi = self.prior_head = -1
        self.prior_count = 0
        unpacked = _unpack(value, done) if value is not None else None
        if unpacked is None:
            return
        head, span, count = unpacked
        # Offsets below `done` are finished; a stale head's count is of one of them.
        self.prior_lo = done
        self.prior_hi = head + span
        if head == done:
            self.prior_head, self.prior_count = head, count

    def prior(self, offset: int) -> int:
        """Deliveries of ``offset`` by earlier members of the group (as far as known)."""
        if offset == self.prior_head:
            return self.prior_count
        return 1 if self.prior_lo <= offset < self.prior_hi else 0

    def head_count(self, offset: int) -> int:
        """How often ``offset`` was delivered so far (this member and earlier ones)."""
        held = self.inflight.get(offset)
        if held is not None:
            return held.delivery_count
        for item in self.queue:
            if item.offset == offset:
                # Fetched, not handed out yet: its count so far is the earlier members'.
                return max(item.delivery_count, self.prior(offset))
            if item.offset > offset:
                break
        return self.prior(offset)


class KafkaDelivery:
    """One delivery of one Kafka record to this member (see :class:`eventflow.ports.Delivery`)."""

    __slots__ = (
        "_part",
        "_settled",
        "delivery_count",
        "headers",
        "key",
        "not_before",
        "offset",
        "payload",
        "topic",
    )

    def __init__(
        self,
        part: Partition,
        offset: int,
        topic: str,
        payload: bytes,
        key: str | None,
        headers: Mapping[str, str],
        count: int,
    ) -> None:
        self._part = part
        self.offset = offset
        self.topic = topic
        self.payload = payload
        self.key = key
        self.headers = headers
        self.delivery_count = count
        self.not_before = 0.0
        self._settled = False

    @property
    def metadata(self) -> Mapping[str, Any]:
        """``{"topic": <Kafka topic>, "partition": int, "offset": int}``."""
        tp = self._part.tp
        return {"topic": tp.topic, "partition": tp.partition, "offset": self.offset}

    async def ack(self) -> None:
        """Mark the record finished; it is committed once every earlier offset is too."""
        if self._settled:
            return
        self._settled = True
        part = self._part
        if part.inflight.pop(self.offset, None) is not None:
            part.member.dirty = True

    async def nack(self, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds; the later records of its key wait for it."""
        if self._give_back(0, delay):
            member = self._part.member
            if delay > 0:
                asyncio.get_running_loop().call_later(delay, member.wake)
            else:
                member.wake()

    async def release(self) -> None:
        """Give the record back uncounted (no handler saw it)."""
        if self._give_back(-1, 0.0):
            self._part.member.wake()

    def _give_back(self, adjust: int, delay: float) -> bool:
        if self._settled:
            return False
        self._settled = True
        part = self._part
        if part.inflight.pop(self.offset, None) is None:
            return False  # the partition moved on (revoked) or the delivery is stale
        again = KafkaDelivery(
            part,
            self.offset,
            self.topic,
            self.payload,
            self.key,
            self.headers,
            self.delivery_count + adjust,
        )
        if delay > 0:
            again.not_before = asyncio.get_running_loop().time() + delay
        part.give_back(again)
        part.member.dirty = True
        return True

    async def in_progress(self) -> None:
        """Nothing to do: Kafka has no per-message deadline (the member's polling keeps it)."""
        return None
