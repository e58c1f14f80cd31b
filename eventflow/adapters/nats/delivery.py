"""A JetStream delivery and a partition's buffer of them (used by ``NatsSubscription``).

A message given back (``nack``/``release``) goes to the head of its partition's buffer,
sorted by stream sequence, so later messages of its key do not overtake it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .subscription import NatsSubscription

__all__ = ["KEY_HEADER", "MSG_ID_HEADER", "NatsDelivery"]

KEY_HEADER = "eventflow-key"
"""NATS header carrying the message key (removed from ``Delivery.headers``)."""
MSG_ID_HEADER = "Nats-Msg-Id"
_INTERNAL = frozenset((KEY_HEADER, MSG_ID_HEADER))
_EMPTY: Mapping[str, str] = {}
_ACK = b""
_NAK = b"-NAK"
_WPI = b"+WPI"
_MAX_BLOCKED_BUFFER = 1000
_PULL_LOST_AFTER = 10.0
_log = logging.getLogger("eventflow.nats")


class NatsDelivery:
    """A message pulled from a partition consumer; settled once (ack, nack or release)."""

    __slots__ = (
        "_comp",
        "_part",
        "_reply",
        "_settled",
        "_sub",
        "consumer_seq",
        "delivery_count",
        "headers",
        "key",
        "payload",
        "seq",
        "topic",
    )

    def __init__(
        self,
        sub: NatsSubscription,
        part: _Part,
        reply: str,
        topic: str,
        payload: bytes,
        key: str | None,
        headers: Mapping[str, str],
        seq: int,
        consumer_seq: int,
        count: int,
        comp: int,
    ) -> None:
        self._sub = sub
        self._part = part
        self._reply = reply
        self._settled = False
        self._comp = comp
        self.topic = topic
        self.payload = payload
        self.key = key
        self.headers = headers
        self.seq = seq
        self.consumer_seq = consumer_seq
        self.delivery_count = count

    @property
    def metadata(self) -> Mapping[str, Any]:
        """Stream, consumer, stream sequence and partition of the message."""
        part = self._part
        return {
            "broker": "nats",
            "stream": self._sub.broker.config.stream,
            "consumer": part.consumer,
            "partition": part.index,
            "stream_seq": self.seq,
            "consumer_seq": self.consumer_seq,
        }

    async def ack(self) -> None:
        """Ack the message (after the handler's effects)."""
        if self._settled:
            return
        self._settled = True
        part = self._part
        if part.out.pop(self.seq, None) is not None and part.draining:
            self._sub.kick()
        await self._sub.nc.publish(self._reply, _ACK)
        if self._comp:
            await self._sub.broker._forget_release(part.consumer, self.seq)

    async def nack(self, delay: float = 0.0) -> None:
        """Give the message back, redelivered after ``delay``; its partition waits for it."""
        if self._settled:
            return
        self._settled = True
        sub, part = self._sub, self._part
        if sub.closed or part.out.pop(self.seq, None) is None:
            return  # given back already, when the subscription closed or lost the partition
        now = sub.now()
        part.awaiting[self.seq] = now + delay + sub.await_guard
        if delay > 0:
            # Held here (and kept alive) rather than nak'd with a server-side delay: the
            # server would meanwhile deliver the key's later messages.
            part.delayed[self.seq] = (now + delay, self)
            sub.kick()
        else:
            await sub.nc.publish(self._reply, _NAK)

    async def release(self) -> None:
        """Give the message back without counting this delivery (no handler saw it).

        The message goes back into this member's buffer at its place in sequence order (the
        server still counts it as delivered once, to us), so it is handed out again first; if
        the member leaves before that, it is given back to the server with the rest, in
        order, and its release recorded so the redelivery is not counted.
        """
        if self._settled:
            return
        self._settled = True
        sub, part = self._sub, self._part
        if sub.closed or part.out.pop(self.seq, None) is None:
            return
        again = NatsDelivery(
            sub,
            part,
            self._reply,
            self.topic,
            self.payload,
            self.key,
            self.headers,
            self.seq,
            self.consumer_seq,
            self.delivery_count,
            self._comp,
        )
        part.insert(again)
        sub._ready.set()
        if part.draining:
            sub.kick()

    async def in_progress(self) -> None:
        """Reset the server's ack timer for this message."""
        if not self._settled:
            await self._sub.nc.publish(self._reply, _WPI)


class _Part:
    """A partition held (leased) by this member."""

    __slots__ = (
        "awaiting",
        "buffer",
        "consumer",
        "delayed",
        "draining",
        "inbox",
        "index",
        "lease_key",
        "lease_rev",
        "next_subject",
        "out",
        "pull_id",
        "pull_left",
        "pull_until",
        "settling",
    )

    def __init__(self, index: int, consumer: str, stream: str, inbox: str, lease_key: str) -> None:
        self.index = index
        self.consumer = consumer
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.inbox = f"{inbox}.{index}"
        self.lease_key = lease_key
        self.lease_rev = 0
        self.draining = False
        self.buffer: deque[NatsDelivery] = deque()  # received, not handed out; by seq
        self.out: dict[int, NatsDelivery] = {}  # handed out, not settled
        self.awaiting: dict[int, float] = {}  # seq given back -> give up waiting at
        self.delayed: dict[int, tuple[float, NatsDelivery]] = {}  # nack(delay): due, delivery
        # A new owner hands out nothing until the consumer's redelivery queue is drained (a
        # first delivery or an ended pull shows it is): what earlier owners gave back may sit
        # in that queue in any order, and the buffer sorts it.
        self.settling = True
        self.pull_id = 0  # the current pull request (named in its reply subject)
        self.pull_left = 0  # messages still owed by the current pull request
        self.pull_until = 0.0  # after this, the request is taken as lost (no status came)

    def insert(self, d: NatsDelivery) -> None:
        """Buffer ``d`` in stream-sequence order (a redelivery or a release goes back in)."""
        buf = self.buffer
        if buf and buf[-1].seq > d.seq:
            pos = len(buf)
            while pos and buf[pos - 1].seq > d.seq:
                pos -= 1
            buf.insert(pos, d)
        else:
            buf.append(d)

    def held(self) -> list[NatsDelivery]:
        """Every message this member holds for the partition, by stream sequence."""
        items = [*self.out.values(), *self.buffer, *(d for _, d in self.delayed.values())]
        items.sort(key=lambda d: d.seq)
        return items
