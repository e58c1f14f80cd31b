"""Per-partition bookkeeping of a Kafka membership and its deliveries.

A partition keeps the records fetched but not handed out (``queue``, in offset order) and
those handed out but not settled (``inflight``); ``nack``/``release`` put a record back at
the head of its queue. The delivery counts carried to the next owner are packed as
(first unfinished offset, handed-out span, its count) in a companion consumer group.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .subscription import KafkaSubscription

__all__ = ["KafkaDelivery", "attempts_group"]

_log = logging.getLogger("eventflow.kafka")
_EMPTY: Mapping[str, str] = {}
_POLL_MS = 100
_PAUSED_POLL_MS = 20
_SETTLE_POLL = 0.005
# The companion value packs (first unfinished offset, handed-out span, its count).
_SPAN_BITS, _COUNT_BITS = 16, 8
_SPAN_MAX, _COUNT_MAX = (1 << _SPAN_BITS) - 1, (1 << _COUNT_BITS) - 1


def attempts_group(group: str) -> str:
    """The companion group that carries delivery counts of ``group`` between members."""
    return f"__eventflow_attempts.{group}"


def _pack(head: int, span: int, count: int) -> int:
    return (
        (head << (_SPAN_BITS + _COUNT_BITS))
        | (min(span, _SPAN_MAX) << _COUNT_BITS)
        | min(count, _COUNT_MAX)
    )


def _unpack(value: int) -> tuple[int, int, int]:
    return (
        value >> (_SPAN_BITS + _COUNT_BITS),
        (value >> _COUNT_BITS) & _SPAN_MAX,
        value & _COUNT_MAX,
    )


class _Partition:
    """What one member knows about one assigned partition."""

    __slots__ = (
        "active",
        "committed",
        "handed_hi",
        "inflight",
        "next_offset",
        "prior_count",
        "prior_head",
        "prior_hi",
        "prior_lo",
        "queue",
        "start",
        "sub",
        "tp",
    )

    def __init__(self, sub: KafkaSubscription, tp: Any) -> None:
        self.sub = sub
        self.tp = tp
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

    def prior(self, offset: int) -> int:
        """Deliveries of ``offset`` by earlier members of the group (as far as known)."""
        if offset == self.prior_head:
            return self.prior_count
        return 1 if self.prior_lo <= offset < self.prior_hi else 0

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

    def head_count(self, offset: int) -> int:
        """How often ``offset`` was delivered so far (this member and earlier ones)."""
        held = self.inflight.get(offset)
        if held is not None:
            return held.delivery_count
        for item in self.queue:
            if item.offset == offset:
                return item.delivery_count
            if item.offset > offset:
                break
        return self.prior(offset)

    def give_back(self, item: KafkaDelivery) -> None:
        """Queue ``item`` again in offset order (normally at the head)."""
        queue = self.queue
        if not queue or queue[0].offset > item.offset:
            queue.appendleft(item)
        else:
            merged = sorted([item, *queue], key=lambda d: d.offset)
            queue.clear()
            queue.extend(merged)
        self.sub._buffered += 1

    def drop(self) -> None:
        """Forget the partition: queued records go, in-flight deliveries become stale."""
        self.sub._buffered -= len(self.queue)
        self.queue.clear()
        self.inflight.clear()
        self.active = False


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
        part: _Partition,
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
            part.sub._dirty = True

    async def nack(self, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds; the partition's later records wait for it."""
        if self._give_back(0, delay):
            sub = self._part.sub
            if delay > 0:
                asyncio.get_running_loop().call_later(delay, sub._wake)
            else:
                sub._wake()

    async def release(self) -> None:
        """Give the record back uncounted (no handler saw it)."""
        if self._give_back(-1, 0.0):
            self._part.sub._wake()

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
        part.sub._dirty = True
        return True

    async def in_progress(self) -> None:
        """Nothing to do: Kafka has no per-message deadline (the member's polling keeps it)."""
        return None
