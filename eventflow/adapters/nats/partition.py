"""A partition held (leased) by one member of a group: its buffer, its pull requests and
the settlement of its deliveries.

Received messages wait in a buffer sorted by stream sequence. A message given back
(``nack``/``release``) goes to the head of the buffer at its place in sequence order, and a
nack'd message holds back the later messages of its key until its redelivery comes back,
so they do not overtake it; the partition's other keys are handed out meanwhile.
Each partition has at most one pull request outstanding: its
end (batch filled, or a status) tells exactly when nothing more can arrive, which is what
a member waits for before it gives the partition up. One that expired is replaced at once
(the member's waiting fetch is woken), so an idle partition is never without one.

The lease bounds what the partition does (see ``docs/nats.md``, "Groups and per-key
order"): ``lease_until`` is when the lease expires at the earliest, by this member's clock
(from the moment it sent the claim or the last refresh). The partition pulls, and extends
ack timers, only while the lease outlives the ack timers that would start (``pull_guard``
= ``ack_wait`` + a margin, past the pull's expiry), and hands out nothing once the lease may
have lapsed: whatever this member was handed is redelivered before anyone else can hold the
partition. A redelivery of a message the member still holds (its ack timer ran out while
the process stalled) is dropped: the member is still on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

from nats.aio.client import Client
from nats.errors import Error as NatsError

from .delivery import NatsDelivery
from .ledger import ReleaseLedger

__all__ = ["ACK", "IN_PROGRESS", "NAK", "Member", "Partition"]

ACK = b""
"""The body of a JetStream ack."""
NAK = b"-NAK"
"""The body of a JetStream nak: redeliver now (counted as a delivery)."""
IN_PROGRESS = b"+WPI"
"""The body of a JetStream "work in progress": reset the ack timer."""
_MAX_BLOCKED_BUFFER = 1000
_PULL_LOST_AFTER = 10.0
_log = logging.getLogger("eventflow.nats")


class Member(Protocol):
    """What a partition needs of the member holding it."""

    @property
    def closed(self) -> bool:
        """Whether the member left (or is leaving) its group."""

    def now(self) -> float:
        """The event loop's clock."""

    def kick(self) -> None:
        """Wake the member's coordinator (a partition drained, a delayed nack)."""

    def wake(self) -> None:
        """Wake a waiting ``fetch`` (messages arrived or can be handed out again)."""


class Partition:
    """A partition held by this member (see the module docstring); the :class:`Settler`
    of its deliveries."""

    __slots__ = (
        "_await_guard",
        "_member",
        "_nc",
        "_pull_guard",
        "_releases",
        "awaiting",
        "buffer",
        "consumer",
        "delayed",
        "draining",
        "inbox",
        "index",
        "lease_key",
        "lease_rev",
        "lease_until",
        "next_subject",
        "out",
        "pull_id",
        "pull_left",
        "pull_until",
        "settling",
        "stream",
    )

    def __init__(
        self,
        index: int,
        consumer: str,
        stream: str,
        inbox: str,
        lease_key: str,
        lease_rev: int,
        lease_until: float,
        *,
        member: Member,
        nc: Client,
        releases: ReleaseLedger,
        await_guard: float,
        pull_guard: float,
    ) -> None:
        self.index = index
        self.consumer = consumer
        self.stream = stream
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.inbox = f"{inbox}.{index}"
        self.lease_key = lease_key
        self.lease_rev = lease_rev
        self.lease_until = lease_until  # the lease expires no sooner (loop clock)
        self._member = member
        self._nc = nc
        self._releases = releases
        # How long to wait for a given-back message to come back before handing out later
        # ones regardless (the server dropped it: max_deliver).
        self._await_guard = await_guard
        # How long the lease must outlive a pull's expiry, or an ack timer extended now.
        self._pull_guard = pull_guard
        self.draining = False
        self.buffer: deque[NatsDelivery] = deque()  # received, not handed out; by seq
        self.out: dict[int, NatsDelivery] = {}  # handed out, not settled
        # seq given back -> (give up waiting at, its key): later messages of the key wait
        self.awaiting: dict[int, tuple[float, str | None]] = {}
        self.delayed: dict[int, tuple[float, NatsDelivery]] = {}  # nack(delay): due, delivery
        # A new owner hands out nothing until the consumer's redelivery queue is drained (a
        # first delivery or an ended pull shows it is): what earlier owners gave back may sit
        # in that queue in any order, and the buffer sorts it.
        self.settling = True
        self.pull_id = 0  # the current pull request (named in its reply subject)
        self.pull_left = 0  # messages still owed by the current pull request
        self.pull_until = 0.0  # after this, the request is taken as lost (no status came)

    # -- receiving ---------------------------------------------------------------------------

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

    def received(self, d: NatsDelivery, count: int) -> None:
        """Buffer ``d``, the server's ``count``-th delivery of it, answering our pull (a
        redelivery of a message this member still holds is dropped)."""
        if self.pull_left:
            self.pull_left -= 1
        if count > 1 and self._holds(d.seq):
            # Its ack timer ran out while this process stalled; the handler (or the buffer)
            # still has it, and acks and in-progress heartbeats go by stream sequence.
            _log.debug(
                "partition %d of %s: duplicate of %d dropped", self.index, self.consumer, d.seq
            )
            return
        self.insert(d)
        if count == 1:
            self.settling = False  # a first delivery: no redelivery is queued ahead of it
        member = self._member
        member.wake()
        if self.draining or member.closed:
            member.kick()

    def pull_ended(self, pull_id: int, *, expired: bool) -> None:
        """A status ended pull request ``pull_id``: it ``expired`` (408), or the server ended
        it for another reason (409: the consumer was deleted or changed leader)."""
        if pull_id != self.pull_id:
            return
        self.pull_left = 0
        member = self._member
        if self.settling:
            self.settling = False  # nothing (more) to redeliver
            member.wake()
        elif expired:
            # The partition has no pull request now: a waiting fetch asks again at once. Left
            # to its own deadline (a second, out of phase with the expiry), it would leave the
            # partition without one for up to that long, and a message published meanwhile
            # would wait for it. Another status is not answered at once: the next fetch round
            # asks again, so a server that refuses pull requests is not asked in a loop.
            member.wake()
        if self.draining or member.closed:
            member.kick()

    def _holds(self, seq: int) -> bool:
        if seq in self.out or seq in self.delayed:
            return True
        for held in self.buffer:  # sorted by sequence
            if held.seq >= seq:
                return held.seq == seq
        return False

    def pull_lost(self) -> None:
        """The connection dropped: the outstanding pull request may have died with it."""
        self.pull_left = 0
        self.pull_until = 0.0

    def pulling(self, now: float) -> bool:
        """Whether a pull request may still deliver (it neither ended nor expired)."""
        return bool(self.pull_left) and now <= self.pull_until

    async def pull(self, want: int, expires: float, now: float) -> None:
        """Ask the server for up to ``want`` messages, unless a request is outstanding or
        nothing could be handed out anyway."""
        if self.draining or now + expires + self._pull_guard > self.lease_until:
            return  # what it brings could outlive the lease: wait for the next refresh
        if self.pull_left:
            if now <= self.pull_until:
                # One request at a time per partition: its end (batch filled, or a status)
                # then tells exactly when nothing more can arrive.
                return
            self.pull_left = 0  # it expired without a status (a reconnect lost it)
        if self.settling:
            if len(self.buffer) >= _MAX_BLOCKED_BUFFER:
                return
            need = want
        elif self.awaiting:
            if len(self.buffer) >= _MAX_BLOCKED_BUFFER:
                return
            # Keys held back until a given-back message returns: the server handles the nak
            # asynchronously, so a later message may have come first; pull on regardless
            # (other keys are handed out meanwhile).
            need = want
        else:
            need = want - len(self.buffer)
        if need <= 0:
            return
        self.pull_id += 1
        self.pull_left = need
        # The server ends a request with a status at `expires`; only a lost connection
        # loses that, and the reconnect handler resets the count. The long fallback keeps a
        # late status from letting two requests overlap.
        self.pull_until = now + expires + _PULL_LOST_AFTER
        request = b'{"batch":%d,"expires":%d}' % (need, int(expires * 1e9))
        await self._nc.publish(self.next_subject, request, reply=f"{self.inbox}.{self.pull_id}")

    def take(self, out: list[NatsDelivery], limit: int, now: float) -> None:
        """Hand out buffered messages into ``out`` (up to ``limit`` in all), in sequence
        order, past those of a key whose earlier message was given back and not yet
        redelivered (:meth:`_take_around`)."""
        buf = self.buffer
        if self.draining or self.settling or not buf or now >= self.lease_until:
            return
        if self.awaiting:
            self._take_around(out, limit, now)
            return
        held = self.out
        while buf and len(out) < limit:
            d = buf.popleft()
            held[d.seq] = d
            out.append(d)

    def _take_around(self, out: list[NatsDelivery], limit: int, now: float) -> None:
        """``take`` while messages given back are awaited: a buffered message waits while
        an earlier message of its key is awaited (a keyless one holds back nothing); one
        awaited too long (the server dropped it: max_deliver) is no longer waited for."""
        awaiting, held = self.awaiting, self.out
        for seq in [seq for seq, (until, _) in awaiting.items() if until < now]:
            del awaiting[seq]  # never came back: stop waiting
        low: dict[str, int] = {}  # key -> its lowest sequence awaited
        for seq, (_, key) in awaiting.items():
            if key is not None and seq < low.get(key, seq + 1):
                low[key] = seq
        kept: deque[NatsDelivery] = deque()
        for d in self.buffer:
            key = d.key
            first = low.get(key) if key is not None else None
            if len(out) >= limit or (first is not None and d.seq > first):
                kept.append(d)
                continue
            if awaiting.pop(d.seq, None) is not None and key is not None and first == d.seq:
                # Its redelivery: the key's later messages may follow, unless another of
                # its messages is awaited too.
                rest = [s for s, (_, k) in awaiting.items() if k == key]
                if rest:
                    low[key] = min(rest)
                else:
                    del low[key]
            held[d.seq] = d
            out.append(d)
        self.buffer = kept

    def held(self) -> list[NatsDelivery]:
        """Every message this member holds for the partition, by stream sequence."""
        items = [*self.out.values(), *self.buffer, *(d for _, d in self.delayed.values())]
        items.sort(key=lambda d: d.seq)
        return items

    # -- settling (the Settler of this partition's deliveries) -------------------------------

    async def ack(self, d: NatsDelivery) -> None:
        """Ack ``d`` and forget its release count, if it had one."""
        if self.out.pop(d.seq, None) is not None and self.draining:
            self._member.kick()
        await self._nc.publish(d.reply, ACK)
        if d.released:
            await self._releases.forget(self.consumer, d.seq)

    async def nack(self, d: NatsDelivery, delay: float) -> None:
        """Give ``d`` back for redelivery after ``delay``; the later messages of its key
        wait for it."""
        member = self._member
        if member.closed or self.out.pop(d.seq, None) is None:
            return  # given back already, when the member left or lost the partition
        now = member.now()
        self.awaiting[d.seq] = (now + delay + self._await_guard, d.key)
        if delay > 0:
            # Held here (and kept alive) rather than nak'd with a server-side delay: the
            # server would meanwhile deliver the key's later messages.
            self.delayed[d.seq] = (now + delay, d)
            member.kick()
        else:
            await self._nc.publish(d.reply, NAK)

    async def release(self, d: NatsDelivery) -> None:
        """Give ``d`` back without counting this delivery (no handler saw it).

        The message goes back into the buffer at its place in sequence order (the server
        still counts it as delivered once, to us), so it is handed out again first; if the
        member leaves before that, it is given back to the server with the rest, in order,
        and its release recorded so the redelivery is not counted.
        """
        member = self._member
        if member.closed or self.out.pop(d.seq, None) is None:
            return
        self.insert(d.again())
        member.wake()
        if self.draining:
            member.kick()

    def may_extend(self, now: float) -> bool:
        """Whether an ack timer reset now ends before the lease may expire."""
        return now + self._pull_guard <= self.lease_until

    async def in_progress(self, d: NatsDelivery) -> None:
        """Reset the server's ack timer for ``d``, unless the timer would then outlive the
        lease (the next lease refresh is followed by in-progress heartbeats anyway)."""
        if self.may_extend(self._member.now()):
            await self._nc.publish(d.reply, IN_PROGRESS)

    async def nak_due(self, now: float) -> None:
        """Nak the delayed nacks that are due (their keys wait for their redelivery)."""
        for seq, (due, d) in list(self.delayed.items()):
            if due <= now:
                del self.delayed[seq]
                self.awaiting[seq] = (now + self._await_guard, d.key)
                await self._nc.publish(d.reply, NAK)

    async def keep_alive(self) -> None:
        """Reset the ack timers of every message held (a handler may still be on it), if
        the lease outlives them (it was just refreshed)."""
        if not self.may_extend(self._member.now()):
            return
        for d in self.held():
            await self._nc.publish(d.reply, IN_PROGRESS)

    async def give_back(self, *, everything: bool, timeout: float) -> None:
        """Nak what the member holds (``everything``: handed out too) in sequence order, so
        it is redelivered in order; messages no handler saw are recorded as released, so
        their redelivery is not counted."""
        items = (
            self.held()
            if everything
            else sorted([*self.buffer, *(d for _, d in self.delayed.values())], key=lambda d: d.seq)
        )
        releases = self._releases
        await asyncio.gather(
            *(releases.record(self.consumer, d.seq, d.released + 1) for d in self.buffer)
        )
        self.buffer.clear()
        self.delayed.clear()
        self.out.clear()
        for d in items:
            d.settled = True
        nc = self._nc
        for d in items[:-1]:
            await nc.publish(d.reply, NAK)
        if items:
            # The server handles acks apart from other requests: wait until it confirmed the
            # last nak (so all of them, in order) before the lease goes, or the next owner's
            # first pull could get a newer message ahead of the given-back ones.
            try:
                await nc.request(items[-1].reply, NAK, timeout=timeout)
            except NatsError as exc:
                _log.warning(
                    "partition %d of %s: nak not confirmed (%s); order may suffer",
                    self.index,
                    self.consumer,
                    exc,
                )
