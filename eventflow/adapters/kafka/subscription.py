"""One consumer-group membership on Kafka: prefetch, per-partition bookkeeping, commits.

A background *pump* task polls ``getmany`` all the time (pausing partitions while the
prefetch buffer is full), so Kafka's ``max_poll_interval`` measures the event loop, not the
handlers: a slow handler cannot trip a rebalance loop. ``fetch`` hands out buffered records.

Per partition a :class:`~.partition.Partition` keeps the records fetched but not handed out
(``queue``, in offset order) and those handed out but not settled (``inflight``), and
counts deliveries; the subscription hands out records from its partitions in turn, and
commits what they say is finished. ``ack`` only drops the offset from ``inflight``; the
pump commits, every ``commit_interval``, the lowest offset still queued or in flight (or
the next offset to fetch): finished work past an unfinished offset waits, so a crash
redelivers from the first unfinished message and loses nothing.

``nack`` and ``release`` put the record back at the head of its partition's queue (a nacked
record blocks its partition's later records until redelivered, which keeps key order).

Rebalances: when partitions are revoked the member stops handing them out, waits up to
``revoke_timeout`` for their in-flight messages to be acked, commits and keeps their state;
a partition assigned back to it resumes where it was, with nothing redelivered.

Delivery counts: Kafka has none, so each partition counts deliveries per offset. To carry
them to the next owner the member commits, next to the group's offsets, a value per
partition in a companion group ``__eventflow_attempts.<group>``: how many offsets past the
first unfinished one were handed out, and how often that first one was delivered (the
encoding is described in :mod:`.partition`). (Commit metadata strings would do, but not every
Kafka-protocol broker keeps them; Tansu does not.)

The pump is a component of the broker's supervisor: a retriable Kafka error ends the run
with a ``BrokerError`` and the supervisor restarts it after a backoff; any other ends the
membership (``fetch`` raises a ``BrokerError``; a bug also fails the component).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import InvalidSessionTimeoutError, KafkaError

from ...errors import BrokerError
from ...supervision import Component, ComponentState, Supervisor
from .config import KafkaBrokerConfig
from .connection import stop_consumer
from .logs import log_new_topics
from .partition import KafkaDelivery, MemberState, Partition

__all__ = ["KafkaSubscription"]

_log = logging.getLogger("eventflow.kafka")
_POLL_MS = 100
_PAUSED_POLL_MS = 20
_SETTLE_POLL = 0.005
# A join longer than this (or than the session timeout) is not a normal one: Kafka holds a
# new group's first join 3 s, Tansu every join half the session timeout. Say what it waits
# for.
_JOIN_NOTE = 4.0


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, sub: KafkaSubscription) -> None:
        self._sub = sub

    async def on_partitions_revoked(self, revoked: Iterable[Any]) -> None:
        await self._sub._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[Any]) -> None:
        await self._sub._on_assigned(set(assigned))


class KafkaSubscription:
    """A live member of a Kafka consumer group (see :class:`eventflow.ports.Subscription`).

    The broker makes it with the group's two started clients (``consumer`` for the group,
    ``companion`` for its delivery counts), the offsets a never-committed partition starts
    from, and ``on_close``, called with the subscription once it has closed.
    """

    def __init__(
        self,
        config: KafkaBrokerConfig,
        pattern: str,
        group: str,
        consumer: AIOKafkaConsumer,
        companion: AIOKafkaConsumer,
        start_offsets: Mapping[Any, int],
        on_close: Callable[[KafkaSubscription], None],
    ) -> None:
        self.pattern = pattern
        self.group = group
        self._consumer = consumer
        self._companion = companion
        self._start_offsets = dict(start_offsets)
        self._on_close = on_close
        self._prefix_len = len(config.topic_prefix)
        self._max_buffer = config.max_buffer
        self._commit_interval = config.commit_interval
        self._revoke_timeout = config.revoke_timeout
        self._session_timeout = config.session_timeout
        self._parts: dict[Any, Partition] = {}
        self._order: list[Partition] = []
        self._rr = 0
        self._revoked: dict[Any, Partition] = {}
        self._member = MemberState()
        self._paused = False
        self._assigned = asyncio.Event()
        self._closed = False
        self._failure: BaseException | None = None
        self._component: Component | None = None
        loop = asyncio.get_running_loop()
        self._now = loop.time

    @property
    def listener(self) -> ConsumerRebalanceListener:
        """The rebalance listener to pass to ``consumer.subscribe``."""
        return _Listener(self)

    async def start(self, supervisor: Supervisor, timeout: float) -> None:
        """Start the pump as a component of ``supervisor`` and wait for the first
        assignment (positions set and committed); past ``timeout`` seconds, a BrokerError."""
        self._component = supervisor.spawn(f"kafka:{self.group}:{self.pattern}", self._run_pump)
        began = self._now()
        note_after = max(_JOIN_NOTE, self._session_timeout)
        told = False
        try:
            async with asyncio.timeout(timeout):
                while not self._assigned.is_set():
                    self._check()
                    if not told and self._now() - began >= note_after:
                        told = True
                        _log.warning(
                            "kafka group %r (%s): no partitions assigned after %.0fs; the "
                            "group is rebalancing, which waits for every member to rejoin: a "
                            "member that stopped heartbeating (killed, or cut off) holds it "
                            "up until session_timeout (%gs) after its last heartbeat, then "
                            "this member gets its share",
                            self.group,
                            self.pattern,
                            note_after,
                            self._session_timeout,
                        )
                    try:
                        async with asyncio.timeout(0.1):
                            await self._assigned.wait()
                    except TimeoutError:
                        pass
            if told:
                _log.info(
                    "kafka group %r (%s): partitions assigned after %.1fs",
                    self.group,
                    self.pattern,
                    self._now() - began,
                )
        except TimeoutError:
            raise BrokerError(
                f"kafka: group {self.group!r} got no partition assignment within {timeout}s; "
                "check that the brokers are reachable and the group coordinator works"
            ) from None

    def _check(self) -> None:
        """Raise ``BrokerError`` once the membership cannot recover (see the module doc)."""
        failure = self._failure
        if failure is None:
            component = self._component
            if component is None or component.state is not ComponentState.FAILED:
                return
            failure = component.last_error
        if isinstance(failure, InvalidSessionTimeoutError):
            raise BrokerError(
                f"kafka: the brokers refuse session_timeout={self._session_timeout:g}s for "
                f"group {self.group!r}: it must lie between their "
                "group.min.session.timeout.ms (6 s by default) and "
                "group.max.session.timeout.ms (30 min); change session_timeout= or the "
                "brokers' limits"
            ) from failure
        raise BrokerError(
            f"kafka consumer of group {self.group!r} on {self.pattern!r} failed: "
            f"{failure!r}; subscribe again"
        ) from failure

    # -- fetching ----------------------------------------------------------------------------

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[KafkaDelivery]:
        """Return 1..max_messages deliveries, or none after ``timeout`` seconds."""
        if self._closed:
            raise BrokerError("fetch on a closed kafka subscription; subscribe again")
        self._check()
        member = self._member
        out = self._take(max_messages) if member.buffered else []
        if out or timeout <= 0:
            return out
        deadline = self._now() + timeout
        wakeup = member.wakeup
        while True:
            wakeup.clear()
            out = self._take(max_messages) if member.buffered else []
            remaining = deadline - self._now()
            if out or remaining <= 0 or self._closed:
                return out
            try:
                async with asyncio.timeout(min(remaining, self._next_due(remaining))):
                    await wakeup.wait()
            except TimeoutError:
                pass
            self._check()

    def _next_due(self, remaining: float) -> float:
        """Wait no longer than until the earliest delayed (nacked) record is due."""
        due = remaining
        now = self._now()
        for part in self._order:
            if part.queue and part.queue[0].not_before:
                due = min(due, max(part.queue[0].not_before - now, 0.001))
        return due

    def _take(self, limit: int) -> list[KafkaDelivery]:
        out: list[KafkaDelivery] = []
        order = self._order
        n = len(order)
        if not n:
            return out
        # Round robin over the partitions, one step further each call: no partition starves.
        start = self._rr = (self._rr + 1) % n
        clock = self._now
        for i in range(n):
            part = order[(start + i) % n]
            if part.queue and part.active:
                part.take(out, limit, clock)
            if len(out) >= limit:
                break
        return out

    # -- the pump ----------------------------------------------------------------------------

    async def _run_pump(self) -> None:
        """The supervised component: the pump, its errors sorted (see the module doc)."""
        try:
            await self._pump()
        except KafkaError as exc:
            if exc.retriable:
                raise BrokerError(
                    f"kafka consumer of group {self.group!r} on {self.pattern!r}: {exc!r}"
                ) from exc
            self._fail(exc)
        except Exception as exc:
            self._fail(exc)
            raise
        finally:
            self._member.wake()  # a fetch waiting now looks at the failure

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            _log.error(
                "kafka consumer of group %r on %r failed and cannot recover: %r; its "
                "subscription ends (fetch raises) and the consumer must subscribe again",
                self.group,
                self.pattern,
                exc,
            )
            self._failure = exc

    async def _pump(self) -> None:
        consumer = self._consumer
        getmany = consumer.getmany
        parts = self._parts
        prefix_len = self._prefix_len
        member = self._member
        next_commit = self._now() + self._commit_interval
        while not self._closed:
            if member.dirty and self._now() >= next_commit:
                next_commit = self._now() + self._commit_interval
                await self._commit(list(parts.values()))
            room = self._max_buffer - member.buffered
            if room <= 0:
                if not self._paused:
                    consumer.pause(*consumer.assignment())
                    self._paused = True
                await getmany(timeout_ms=_PAUSED_POLL_MS)
                continue
            if self._paused:
                consumer.resume(*consumer.assignment())
                self._paused = False
            batch = await getmany(timeout_ms=_POLL_MS, max_records=room)
            if not batch:
                continue
            filed = 0
            for tp, records in batch.items():
                part = parts.get(tp)
                if part is None:
                    continue  # revoked while the batch was in flight; refetched by its owner
                # One slice per batch (no copy without a prefix); a name cache would grow
                # with every topic a wildcard subscription ever saw.
                filed += part.file(records, tp.topic[prefix_len:])
            if filed:
                member.wake()

    # -- commits -----------------------------------------------------------------------------

    async def _commit(self, parts: Sequence[Partition]) -> bool:
        """Commit the first unfinished offset of each partition (and the companion counts)."""
        self._member.dirty = False
        offsets: dict[Any, int] = {}
        counts: dict[Any, int] = {}
        for part in parts:
            due = part.to_commit()
            if due is not None:
                offsets[part.tp], counts[part.tp] = due
        if not offsets:
            return True
        try:
            await self._consumer.commit(offsets)
            await self._companion.commit(counts)
        except (KafkaError, AssertionError) as exc:
            # A rebalance is under way: the revocation commits what is finished.
            _log.debug("kafka commit for group %r deferred: %s", self.group, exc)
            self._member.dirty = True
            return False
        for part in parts:
            if part.tp in offsets:
                part.committed = (offsets[part.tp], counts[part.tp])
        return True

    # -- rebalances --------------------------------------------------------------------------

    async def _on_revoked(self, revoked: set[Any]) -> None:
        parts = [p for tp, p in self._parts.items() if tp in revoked]
        for part in parts:
            part.active = False
        if not self._closed and any(p.inflight for p in parts):
            deadline = self._now() + self._revoke_timeout
            while any(p.inflight for p in parts) and not self._closed:
                if self._now() >= deadline:
                    _log.warning(
                        "kafka group %r: %d messages still unacked after revoke_timeout=%ss; "
                        "their partitions move on and they will be redelivered",
                        self.group,
                        sum(len(p.inflight) for p in parts),
                        self._revoke_timeout,
                    )
                    break
                await asyncio.sleep(_SETTLE_POLL)
        if parts:
            await self._commit(parts)
        for part in parts:
            self._revoked[part.tp] = part
            del self._parts[part.tp]
        self._order = list(self._parts.values())

    async def _on_assigned(self, assigned: set[Any]) -> None:
        consumer = self._consumer
        self._paused = False
        new: list[Partition] = []
        for tp in assigned:
            part = self._revoked.pop(tp, None)
            if part is not None:
                # Ours again: carry on where we were, nothing redelivered.
                pos = part.resume_position()
                if pos is not None:
                    consumer.seek(tp, pos)
                part.active = True
            else:
                part = Partition(tp, self._member)
                new.append(part)
            self._parts[tp] = part
        for part in self._revoked.values():
            part.drop()
        self._revoked.clear()
        self._order = list(self._parts.values())
        if new:
            try:
                await self._start_partitions(new, assigned)
            except Exception as exc:
                _log.error("kafka group %r: could not set start positions: %s", self.group, exc)
                self._failure = exc
        self._assigned.set()
        self._member.wake()

    async def _start_partitions(self, new: list[Partition], assigned: set[Any]) -> None:
        consumer, companion = self._consumer, self._companion
        companion.assign(list(assigned))
        companion.pause(*assigned)
        tps = [p.tp for p in new]
        committed = await asyncio.gather(*(consumer.committed(tp) for tp in tps))
        prior = await asyncio.gather(*(companion.committed(tp) for tp in tps))
        missing = [tp for tp, c in zip(tps, committed, strict=True) if c is None]
        unknown = [tp for tp in missing if tp not in self._start_offsets]
        earliest = await consumer.beginning_offsets(unknown) if unknown else {}
        if self._assigned.is_set():  # after the join: topics created since (or partitions)
            log_new_topics(self.group, self.pattern, unknown, self._prefix_len)
        to_commit: dict[Any, int] = {}
        for part, done, value in zip(new, committed, prior, strict=True):
            tp = part.tp
            if done is None:
                # A partition the group never committed: a topic that existed when this
                # member subscribed starts at its end then; a topic created since, at its
                # beginning (everything in it came after the subscription).
                pos = self._start_offsets.get(tp)
                if pos is None:
                    pos = earliest[tp]
                consumer.seek(tp, pos)
                to_commit[tp] = pos
                part.start_from(pos, value, refetch=True)
            else:
                part.start_from(done, value, refetch=False)
        if to_commit:
            await consumer.commit(to_commit)
        for part in new:
            part.active = True

    # -- closing -----------------------------------------------------------------------------

    async def close(self) -> None:
        """Commit what is finished and leave the group; unacked messages are redelivered.

        Cancelled midway, it still stops the clients, then lets the cancellation through."""
        if self._closed:
            return
        self._closed = True
        self._member.wake()
        component, self._component = self._component, None
        try:
            if component is not None:
                await component.stop()
            if self._failure is None:
                try:
                    # aiokafka retries a commit for ever while the brokers are away; past
                    # session_timeout the group has evicted this member and would refuse it.
                    async with asyncio.timeout(self._session_timeout):
                        await self._commit(list(self._parts.values()))
                except TimeoutError:
                    _log.warning(
                        "kafka group %r: the final commit got no answer within "
                        "session_timeout=%ss; unfinished messages will be redelivered",
                        self.group,
                        self._session_timeout,
                    )
                except Exception as exc:
                    _log.warning("kafka group %r: final commit failed: %s", self.group, exc)
        finally:
            for part in self._parts.values():
                part.drop()
            try:
                await stop_consumer(self._consumer)
            finally:
                await stop_consumer(self._companion)
                self._on_close(self)
