"""The broker contract's lag tests: ``Broker.lag`` counts what a group has not handled
(not yet delivered, or delivered and not acked; on Kafka not committed), for that group
only, held by a live member or by one that died, and dates the oldest of it with the
broker's publish time.

Publish times are told apart by publishing ``spacing`` seconds apart (1.6 s) and allowing
``clock_tolerance`` (1 s) between the broker's clock and the test's, both on one machine: a
date must fall within the tolerance of its own publish call and nearer to it than to any
other, so an adapter that gives the newest message's time (or any other's) fails. Acks
that count a moment later (Kafka's commit interval, NATS's acks sent without a reply) are
waited for with bounded polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta

from ...ports import Broker, Lag, declared
from .support import BrokerContractBase, BrokerFactory, collect, eventually, unique_name

__all__ = ["Die", "LagContract", "PublishTime"]

PublishTime = tuple[datetime, datetime]
"""The test's clock just before and just after one publish call returned."""

Die = Callable[[], Awaitable[None]]
"""Waits until a member holds its messages, then kills it (see ``hold_and_die``)."""


class LagContract(BrokerContractBase):
    """``lag(pattern, group=)``: what a group has not handled on a pattern, and since when.

    :meth:`hold_and_die` makes a member that holds messages and dies; by default a child
    process (``holder.py``) on the ``url`` of a broker of ``broker_factory``, SIGKILLed. A
    broker that lives in the test's process overrides it, and so does a module whose
    brokers have settings their ``url`` leaves out that decide where messages go (a Kafka
    ``topic_prefix``, a NATS ``subject_prefix`` or partition count).
    """

    spacing: float = 1.6
    """Seconds between the publishes whose times a test tells apart."""
    clock_tolerance: float = 1.0
    """Seconds the broker's clock may differ from the test's (one machine)."""

    async def _lag(self, broker: Broker, pattern: str, group: str) -> Lag:
        value = await declared(broker, Broker, "lag")(pattern, group=group)
        assert isinstance(value, Lag), value
        assert value.messages >= 0, value
        assert (value.oldest is None) == (value.messages == 0), value
        if value.oldest is not None:
            assert value.oldest.utcoffset() == timedelta(0), f"not UTC: {value}"
        return value

    async def _publish_spaced(
        self, broker: Broker, messages: Sequence[tuple[str, str]]
    ) -> list[PublishTime]:
        """Publish ``(topic, key)`` messages ``spacing`` seconds apart; their times."""
        times: list[PublishTime] = []
        for i, (topic, key) in enumerate(messages):
            if i:
                await asyncio.sleep(self.spacing)
            before = datetime.now(UTC)
            await broker.publish(topic, f"m{i}".encode(), key=key)
            times.append((before, datetime.now(UTC)))
        return times

    def _dated(self, lag: Lag, times: Sequence[PublishTime], index: int) -> bool:
        """Whether ``lag.oldest`` is the publish time of message ``index`` of ``times``."""
        oldest = lag.oldest
        if oldest is None:
            return False
        tolerance = timedelta(seconds=self.clock_tolerance)
        before, after = times[index]
        if not before - tolerance <= oldest <= after + tolerance:
            return False

        def distance(window: PublishTime) -> float:
            middle = window[0] + (window[1] - window[0]) / 2
            return abs((oldest - middle).total_seconds())

        own = distance(times[index])
        return all(own < distance(w) for i, w in enumerate(times) if i != index)

    async def _becomes(
        self,
        broker: Broker,
        pattern: str,
        group: str,
        messages: int | tuple[int, ...],
        times: Sequence[PublishTime] = (),
        index: int | None = None,
    ) -> Lag:
        """Poll until the lag counts ``messages`` (one of them) and, with ``index``, is
        dated with message ``index``'s publish time; fail with what was seen."""
        counts = (messages,) if isinstance(messages, int) else messages
        seen: list[Lag] = []

        async def reached() -> bool:
            seen.append(await self._lag(broker, pattern, group))
            lag = seen[-1]
            return lag.messages in counts and (index is None or self._dated(lag, times, index))

        try:
            await eventually(reached, timeout=self.timeout, interval=0.1)
        except AssertionError:
            dated = "" if index is None else f" dated with message {index} of {times}"
            raise AssertionError(
                f"lag of {group} on {pattern} never became {counts}{dated}: last {seen[-3:]}"
            ) from None
        return seen[-1]

    async def test_a_group_nobody_created_has_no_lag(self, broker_factory: BrokerFactory) -> None:
        """Messages on the topic, but no group: Lag(0, None) on the topic and on a
        wildcard matching it; a group created after them has nothing to handle either."""
        publisher, observer = await broker_factory(), await broker_factory()
        root = unique_name()
        topic = f"{root}.lag.placed"
        for i in range(3):
            await publisher.publish(topic, f"m{i}".encode(), key=f"k{i}")
        for pattern in (topic, f"{root}.>"):
            assert await self._lag(observer, pattern, unique_name("g")) == Lag(0, None)
        group = unique_name("g")
        sub = await (await broker_factory()).subscribe(topic, group=group)  # start="latest"
        assert await self._lag(observer, topic, group) == Lag(0, None)
        await publisher.publish(topic, b"after", key="k0")  # positive control: it counts
        await self._becomes(observer, topic, group, 1)
        await collect(sub, 1, timeout=self.timeout)
        await self._becomes(observer, topic, group, 0)

    async def test_lag_counts_and_dates_what_a_group_has_not_handled(
        self, broker_factory: BrokerFactory
    ) -> None:
        """Three messages of one key, ``spacing`` apart: not delivered, then the first
        held by a member, then all three held, they count 3 and date from the first;
        another group that acked them has none. Acking the first moves the date to the
        second; acking the third, out of order, leaves it there; acking the second leaves
        nothing."""
        publisher, observer = await broker_factory(), await broker_factory()
        topic = f"{unique_name()}.lag"
        group, other = unique_name("g"), unique_name("g")
        sub = await (await broker_factory()).subscribe(topic, group=group)
        done = await (await broker_factory()).subscribe(topic, group=other)
        assert await self._lag(observer, topic, group) == Lag(0, None)
        times = await self._publish_spaced(publisher, [(topic, "k")] * 3)
        await self._becomes(observer, topic, group, 3, times, 0)  # not delivered yet
        await collect(done, 3, timeout=self.timeout)
        await self._becomes(observer, topic, other, 0)  # the other group's lag is its own
        held = await collect(sub, 1, timeout=self.timeout, ack=False)
        lag = await self._lag(observer, topic, group)  # one out, two not delivered
        assert lag.messages == 3 and self._dated(lag, times, 0), (lag, times)
        held += await collect(sub, 2, timeout=self.timeout, ack=False)
        assert [d.payload for d in held] == [b"m0", b"m1", b"m2"]
        lag = await self._lag(observer, topic, group)  # delivered, not acked
        assert lag.messages == 3 and self._dated(lag, times, 0), (lag, times)
        await held[0].ack()
        await self._becomes(observer, topic, group, 2, times, 1)
        await held[2].ack()  # the second is still out: the date stays with it
        loop = asyncio.get_running_loop()
        until = loop.time() + self.quiet_period + 0.5
        while loop.time() < until:
            lag = await self._lag(observer, topic, group)
            assert lag.messages in (1, 2) and self._dated(lag, times, 1), (lag, times)
            await asyncio.sleep(0.1)
        await held[1].ack()
        await self._becomes(observer, topic, group, 0)
        assert await self._lag(publisher, topic, group) == Lag(0, None)  # any broker

    async def test_lag_of_a_wildcard_group_spans_its_topics(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A group on a wildcard counts every topic it matches and dates from the oldest
        message of any of them."""
        publisher, observer = await broker_factory(), await broker_factory()
        root, group = unique_name(), unique_name("g")
        topics = [f"{root}.a.placed", f"{root}.b.placed"]
        for topic in topics:  # the topics exist before the group joins (Kafka: no rebalance)
            await publisher.publish(topic, b"before", key="k")
        sub = await (await broker_factory()).subscribe(f"{root}.>", group=group)
        await self._becomes(observer, f"{root}.>", group, 0)  # earlier messages are not its
        times = await self._publish_spaced(publisher, [(topics[0], "k0"), (topics[1], "k1")])
        await self._becomes(observer, f"{root}.>", group, 2, times, 0)
        held = await collect(sub, 2, timeout=self.timeout, ack=False)
        first = next(d for d in held if d.topic == topics[0])
        await first.ack()
        await self._becomes(observer, f"{root}.>", group, 1, times, 1)
        for delivery in held:
            if delivery is not first:
                await delivery.ack()
        await self._becomes(observer, f"{root}.>", group, 0)

    async def test_a_dead_members_held_messages_count(self, broker_factory: BrokerFactory) -> None:
        """A member that fetched two messages (of two keys) and died without acking or
        leaving: both still count, dated from the first."""
        publisher, observer = await broker_factory(), await broker_factory()
        topic, group = f"{unique_name()}.lag", unique_name("g")
        async with self.hold_and_die(broker_factory, topic, group, 2) as die:
            times = await self._publish_spaced(publisher, [(topic, "k0"), (topic, "k1")])
            await die()
        lag = await self._lag(observer, topic, group)
        assert lag.messages == 2 and self._dated(lag, times, 0), (lag, times)

    @contextlib.asynccontextmanager
    async def hold_and_die(
        self, broker_factory: BrokerFactory, pattern: str, group: str, count: int
    ) -> AsyncIterator[Die]:
        """A member of ``group`` on ``pattern``, joined when this enters; the callable it
        yields waits until the member holds ``count`` messages (fetched, not acked), then
        kills it as a crash would: it acks, releases and leaves nothing."""
        url = (await broker_factory()).url
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "eventflow.testing.broker_contract.holder",
            url,
            pattern,
            group,
            str(count),
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        out = process.stdout

        async def line() -> str:
            async with asyncio.timeout(self.timeout + 10.0):  # a process starting, a join
                text = (await out.readline()).decode().strip()
            assert text, f"the holder process ended (exit code {await process.wait()})"
            return text

        async def die() -> None:
            assert await line() == f"held {count}"
            os.kill(process.pid, signal.SIGKILL)
            await process.wait()

        try:
            assert await line() == "joined"
            yield die
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
