"""The Broker port's contract suite, shared by every broker adapter.

An adapter's test module subclasses :class:`BrokerContract` and provides one fixture,
``broker_factory``: an async callable that returns a new, started broker connected to the
same backend (another "process" of the same deployment), closing them all after the test::

    class TestMemoryBroker(BrokerContract):
        @pytest.fixture
        async def broker_factory(self) -> AsyncIterator[BrokerFactory]:
            name = unique_name("hub")
            async with broker_pool(lambda: MemoryBroker(MemoryBrokerConfig(name=name))) as f:
                yield f

Every test uses fresh topic and group names, so a real server can be shared by all tests.
Waits are bounded polls; a subclass on a slow server raises ``timeout`` (how long to wait
for something that must happen) or ``quiet_period`` (how long to watch for something that
must not happen).
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import orjson
import pytest

from ..errors import BrokerError, ConfigurationError
from ..ports import Broker, Delivery, Subscription

__all__ = [
    "BrokerContract",
    "BrokerFactory",
    "Member",
    "broker_pool",
    "collect",
    "drain",
    "eventually",
    "unique_name",
]

BrokerFactory = Callable[[], Awaitable[Broker]]
"""Returns a new started broker on the shared backend; the fixture closes it after the test."""

DEFAULT_TIMEOUT = 10.0
DEFAULT_QUIET_PERIOD = 0.5
_POLL_INTERVAL = 0.02
_FETCH_WAIT = 0.5


def unique_name(prefix: str = "ct") -> str:
    """A fresh name usable as a topic token, group or hub name on every broker."""
    return f"{prefix}{uuid.uuid4().hex[:16]}"


async def eventually(
    condition: Callable[[], object],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = _POLL_INTERVAL,
    message: str = "condition",
) -> None:
    """Poll ``condition`` (sync, or returning an awaitable) until truthy; fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        if loop.time() >= deadline:
            raise AssertionError(f"{message} still false after {timeout}s")
        await asyncio.sleep(interval)


async def collect(
    sub: Subscription,
    count: int,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    ack: bool = True,
    max_messages: int = 10,
) -> list[Delivery]:
    """Fetch exactly ``count`` deliveries (acking each if ``ack``); fail after ``timeout``.

    Never asks for more than are still missing, so nothing extra is left in flight.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    out: list[Delivery] = []
    while len(out) < count:
        remaining = deadline - loop.time()
        if remaining <= 0:
            got = [(d.topic, d.payload, d.key) for d in out]
            raise AssertionError(f"expected {count} deliveries within {timeout}s, got {got}")
        batch = await sub.fetch(min(max_messages, count - len(out)), min(remaining, _FETCH_WAIT))
        for delivery in batch:
            out.append(delivery)
            if ack:
                await delivery.ack()
    return out


async def drain(sub: Subscription, duration: float, *, ack: bool = True) -> list[Delivery]:
    """Fetch for ``duration`` seconds and return everything that arrived (acked if ``ack``).

    Used to check that something does not happen: an empty result means nothing came.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration
    out: list[Delivery] = []
    while (remaining := deadline - loop.time()) > 0:
        batch = await sub.fetch(10, min(remaining, _FETCH_WAIT))
        for delivery in batch:
            out.append(delivery)
            if ack:
                await delivery.ack()
    return out


@asynccontextmanager
async def broker_pool(make: Callable[[], Broker]) -> AsyncIterator[BrokerFactory]:
    """Yield a :data:`BrokerFactory` that starts brokers built by ``make``; close them at exit."""
    brokers: list[Broker] = []

    async def factory() -> Broker:
        broker = make()
        await broker.start()
        brokers.append(broker)
        return broker

    try:
        yield factory
    finally:
        for broker in reversed(brokers):
            await broker.close()


class Member:
    """A group member that fetches and acks in the background, recording what it got.

    ``log`` may be shared between members to see the order in which the group received
    messages. Run :meth:`run` as a task and cancel it to stop.
    """

    def __init__(
        self, name: str, sub: Subscription, log: list[tuple[str, Delivery]] | None = None
    ) -> None:
        self.name = name
        self.sub = sub
        self.received: list[Delivery] = []
        self.log = log if log is not None else []

    async def run(self) -> None:
        """Fetch, record and ack until cancelled."""
        while True:
            for delivery in await self.sub.fetch(10, _FETCH_WAIT):
                self.received.append(delivery)
                self.log.append((self.name, delivery))
                await delivery.ack()


async def _run_members(
    members: Sequence[Member], done: Callable[[], bool], *, timeout: float, quiet: float
) -> None:
    """Run ``members`` until ``done()``, then ``quiet`` seconds more (to catch extras)."""
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(m.run()) for m in members]
        try:
            await eventually(done, timeout=timeout, message="members received everything")
            await asyncio.sleep(quiet)  # a window for duplicates to show up, not a sync point
        finally:
            for task in tasks:
                task.cancel()


def _texts(deliveries: Sequence[Delivery]) -> list[str]:
    return [d.payload.decode() for d in deliveries]


class BrokerContract:
    """The guarantees of :class:`eventflow.ports.Broker`, as tests every adapter must pass.

    Subclass it as ``class TestXBroker(BrokerContract)`` and provide the ``broker_factory``
    fixture (see the module docstring). It has no ``Test`` prefix so that pytest collects it
    only through its subclasses.
    """

    timeout: float = DEFAULT_TIMEOUT
    """Seconds to wait for something that must happen."""
    quiet_period: float = DEFAULT_QUIET_PERIOD
    """Seconds to watch for something that must not happen (an extra delivery)."""
    nack_delay: float = 1.0
    """The delay used in the ``nack(delay)`` tests."""

    # -- publish and subscribe ---------------------------------------------------------------

    async def test_round_trip_preserves_payload_key_and_headers(
        self, broker_factory: BrokerFactory
    ) -> None:
        """Payload bytes, topic, key and headers arrive unchanged; metadata is a mapping."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.order.placed", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        headers = {
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "content-type": "application/json",
            "x-note": "a value with spaces = and ;",
        }
        payload = b'{"order_id": "o-1", "qty": 2}'
        await broker.publish(topic, payload, key="o-1", headers=headers)

        [d] = await collect(sub, 1, timeout=self.timeout, ack=False)
        assert d.topic == topic
        assert d.payload == payload
        assert isinstance(d.payload, bytes)
        assert d.key == "o-1"
        assert dict(d.headers) == headers
        assert d.delivery_count == 1
        assert isinstance(d.metadata, Mapping)
        assert isinstance(d, Delivery)
        assert isinstance(sub, Subscription)
        assert isinstance(broker, Broker)
        assert sub.pattern == topic
        assert sub.group == group
        await d.ack()
        assert await drain(sub, self.quiet_period) == []

    async def test_message_without_key_or_headers(self, broker_factory: BrokerFactory) -> None:
        """A keyless message arrives with ``key`` None and empty headers."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.ping", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"ping")
        [d] = await collect(sub, 1, timeout=self.timeout)
        assert d.payload == b"ping"
        assert d.key is None
        assert dict(d.headers) == {}

    async def test_payload_is_opaque_bytes(self, broker_factory: BrokerFactory) -> None:
        """Bytes that are not JSON, not UTF-8, empty or large are carried unchanged."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.raw", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        payloads = [
            b"not json {",
            bytes(range(256)),
            b"\xff\xfe\x00\x00garbage",
            b"",
            b"\x00" * 1024 + b"x" * (100 * 1024),
        ]
        for payload in payloads:
            await broker.publish(topic, payload, key="same")
        got = await collect(sub, len(payloads), timeout=self.timeout)
        assert [d.payload for d in got] == payloads

    async def test_metadata_identifies_the_message(self, broker_factory: BrokerFactory) -> None:
        """``metadata`` is a JSON-serialisable mapping that differs between two messages."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.meta", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"one", key="k")
        await broker.publish(topic, b"two", key="k")
        first, second = await collect(sub, 2, timeout=self.timeout)
        for d in (first, second):
            assert isinstance(d.metadata, Mapping)
            assert all(isinstance(k, str) for k in d.metadata)
            orjson.dumps(dict(d.metadata))  # dead-letter stores persist it as JSON
        assert dict(first.metadata) != dict(second.metadata)

    async def test_only_messages_published_after_subscribe_are_received(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A new group gets what was published after ``subscribe`` returned, and nothing before."""
        publisher = await broker_factory()
        consumer = await broker_factory()
        topic, group = f"{unique_name()}.evt", unique_name("g")
        await publisher.publish(topic, b"before", key="k")  # no subscriber yet: accepted, unseen
        sub = await consumer.subscribe(topic, group=group)
        await publisher.publish(topic, b"after", key="k")
        got = await collect(sub, 1, timeout=self.timeout)
        assert _texts(got) == ["after"]
        assert await drain(sub, self.quiet_period) == []

    async def test_fetch_returns_empty_after_timeout(self, broker_factory: BrokerFactory) -> None:
        """With nothing to deliver, ``fetch`` waits about its timeout and returns nothing."""
        broker = await broker_factory()
        sub = await broker.subscribe(f"{unique_name()}.idle", group=unique_name("g"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        got = await sub.fetch(10, 0.5)
        elapsed = loop.time() - start
        assert list(got) == []
        assert 0.4 <= elapsed < self.timeout

    async def test_fetch_returns_at_most_max_messages(self, broker_factory: BrokerFactory) -> None:
        """``fetch(n, ...)`` returns between 1 and n deliveries when messages are waiting."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.batch", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        for i in range(5):
            await broker.publish(topic, f"m{i}".encode(), key="k")
        got = list(await sub.fetch(2, self.timeout))
        assert 1 <= len(got) <= 2
        for d in got:
            await d.ack()
        rest = await collect(sub, 5 - len(got), timeout=self.timeout)
        assert _texts([*got, *rest]) == [f"m{i}" for i in range(5)]

    # -- patterns ----------------------------------------------------------------------------

    async def test_single_token_wildcard(self, broker_factory: BrokerFactory) -> None:
        """``*`` matches exactly one token; other topics are not delivered."""
        broker = await broker_factory()
        root, group = unique_name(), unique_name("g")
        sub = await broker.subscribe(f"{root}.*.created", group=group)
        for topic in (
            f"{root}.created",
            f"{root}.a.b.created",
            f"{root}.a.deleted",
            f"{unique_name()}.a.created",
        ):
            await broker.publish(topic, b"no", key="k")
        await broker.publish(f"{root}.order.created", b"yes-1", key="k")
        await broker.publish(f"{root}.user.created", b"yes-2", key="k")
        got = await collect(sub, 2, timeout=self.timeout)
        assert sorted((d.topic, d.payload) for d in got) == [
            (f"{root}.order.created", b"yes-1"),
            (f"{root}.user.created", b"yes-2"),
        ]
        assert await drain(sub, self.quiet_period) == []

    async def test_multi_token_wildcard(self, broker_factory: BrokerFactory) -> None:
        """``>`` matches one or more trailing tokens; the bare prefix and other roots do not."""
        broker = await broker_factory()
        root, group = unique_name(), unique_name("g")
        sub = await broker.subscribe(f"{root}.order.>", group=group)
        for topic in (f"{root}.order", f"{root}.user.placed", f"{unique_name()}.order.placed"):
            await broker.publish(topic, b"no", key="k")
        wanted = [f"{root}.order.placed", f"{root}.order.item.added", f"{root}.order.a.b.c"]
        for topic in wanted:
            await broker.publish(topic, topic.encode(), key="k")
        got = await collect(sub, len(wanted), timeout=self.timeout)
        assert sorted(d.topic for d in got) == sorted(wanted)
        assert all(d.payload == d.topic.encode() for d in got)
        assert await drain(sub, self.quiet_period) == []

    async def test_invalid_patterns_and_topics_raise_configuration_error(
        self, broker_factory: BrokerFactory
    ) -> None:
        """Malformed patterns, topics and group names raise ``ConfigurationError``."""
        broker = await broker_factory()
        root = unique_name()
        for pattern in ("", f"{root}..x", f"{root}.a*", f"{root}.>.x", f"{root}.x>", "a b"):
            with pytest.raises(ConfigurationError):
                await broker.subscribe(pattern, group=unique_name("g"))
        with pytest.raises(ConfigurationError):
            await broker.subscribe(f"{root}.ok", group="")
        for topic in ("", f"{root}.*", f"{root}.>", f"{root}..x", f"{root}.", "a b"):
            with pytest.raises(ConfigurationError):
                await broker.publish(topic, b"x")
        # the broker still works after refusing them
        sub = await broker.subscribe(f"{root}.ok", group=unique_name("g"))
        await broker.publish(f"{root}.ok", b"fine")
        assert _texts(await collect(sub, 1, timeout=self.timeout)) == ["fine"]

    # -- groups ------------------------------------------------------------------------------

    async def test_every_group_receives_every_message(self, broker_factory: BrokerFactory) -> None:
        """Each group (exact or wildcard pattern, any broker) gets all matching messages."""
        publisher = await broker_factory()
        root = unique_name()
        topic = f"{root}.stock.reserved"
        subs = [
            await (await broker_factory()).subscribe(topic, group=unique_name("g")),
            await (await broker_factory()).subscribe(topic, group=unique_name("g")),
            await (await broker_factory()).subscribe(f"{root}.>", group=unique_name("g")),
        ]
        payloads = [f"m{i}" for i in range(10)]
        for p in payloads:
            await publisher.publish(topic, p.encode(), key="k")
        for sub in subs:
            assert _texts(await collect(sub, len(payloads), timeout=self.timeout)) == payloads
        for sub in subs:
            assert await drain(sub, self.quiet_period) == []

    async def test_competing_consumers_share_a_group(self, broker_factory: BrokerFactory) -> None:
        """Within a group each message reaches exactly one live member, and both get some."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.work", unique_name("g")
        members = [
            Member(f"m{i}", await (await broker_factory()).subscribe(topic, group=group))
            for i in range(2)
        ]
        n = 64
        for i in range(n):
            await publisher.publish(topic, f"job-{i}".encode(), key=f"key-{i}")
        await _run_members(
            members,
            lambda: sum(len(m.received) for m in members) >= n,
            timeout=self.timeout,
            quiet=self.quiet_period,
        )
        counts = Counter(p for m in members for p in _texts(m.received))
        assert counts == Counter(f"job-{i}" for i in range(n)), "each message exactly once"
        assert all(m.received for m in members), [len(m.received) for m in members]

    async def test_per_key_order_with_two_members(self, broker_factory: BrokerFactory) -> None:
        """Two members of one group see each key's messages in publish order."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.ordered", unique_name("g")
        log: list[tuple[str, Delivery]] = []
        members = [
            Member(f"m{i}", await (await broker_factory()).subscribe(topic, group=group), log)
            for i in range(2)
        ]
        keys, per_key = [f"k{i}" for i in range(16)], 10
        for seq in range(per_key):
            for key in keys:
                await publisher.publish(topic, f"{key}:{seq}".encode(), key=key)
        total = len(keys) * per_key
        await _run_members(
            members, lambda: len(log) >= total, timeout=self.timeout, quiet=self.quiet_period
        )
        seen: dict[str, list[int]] = defaultdict(list)
        for _, d in log:
            key, number = d.payload.decode().split(":")
            assert d.key == key
            seen[key].append(int(number))
        assert seen == {key: list(range(per_key)) for key in keys}
        assert all(m.received for m in members), [len(m.received) for m in members]

    async def test_group_keeps_messages_while_it_has_no_members(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A group whose members all left still receives; the next member gets the messages."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.durable", unique_name("g")
        first = await (await broker_factory()).subscribe(topic, group=group)
        await publisher.publish(topic, b"m0", key="k")
        assert _texts(await collect(first, 1, timeout=self.timeout)) == ["m0"]
        await first.close()
        for i in range(1, 4):
            await publisher.publish(topic, f"m{i}".encode(), key="k")
        second = await (await broker_factory()).subscribe(topic, group=group)
        got = await collect(second, 3, timeout=self.timeout)
        assert _texts(got) == ["m1", "m2", "m3"]
        assert await drain(second, self.quiet_period) == []

    # -- acknowledgement and redelivery ------------------------------------------------------

    async def test_unacked_delivery_is_redelivered_after_close(
        self, broker_factory: BrokerFactory
    ) -> None:
        """Deliveries left unacked when a subscription closes go to another member, in order."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.redeliver", unique_name("g")
        first = await (await broker_factory()).subscribe(topic, group=group)
        for i in range(3):
            await publisher.publish(topic, f"m{i}".encode(), key="k")
        held = await collect(first, 3, timeout=self.timeout, ack=False)
        assert [d.delivery_count for d in held] == [1, 1, 1]
        second = await (await broker_factory()).subscribe(topic, group=group)
        await first.close()
        again = await collect(second, 3, timeout=self.timeout)
        assert _texts(again) == ["m0", "m1", "m2"]
        assert all(d.delivery_count >= 2 for d in again), [d.delivery_count for d in again]
        assert await drain(second, self.quiet_period) == []

    async def test_unacked_delivery_is_redelivered_after_broker_close(
        self, broker_factory: BrokerFactory
    ) -> None:
        """Closing a broker (a process going away) gives its unacked deliveries back."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.crash", unique_name("g")
        doomed = await broker_factory()
        first = await doomed.subscribe(topic, group=group)
        await publisher.publish(topic, b"m0", key="k")
        [held] = await collect(first, 1, timeout=self.timeout, ack=False)
        assert held.delivery_count == 1
        second = await (await broker_factory()).subscribe(topic, group=group)
        await doomed.close()
        [again] = await collect(second, 1, timeout=self.timeout)
        assert again.payload == b"m0"
        assert again.delivery_count >= 2

    async def test_acked_messages_are_never_redelivered(
        self, broker_factory: BrokerFactory
    ) -> None:
        """After close and resubscribe (same or new broker) only unacked messages come back."""
        publisher = await broker_factory()
        consumer = await broker_factory()
        topic, group = f"{unique_name()}.acked", unique_name("g")
        sub = await consumer.subscribe(topic, group=group)
        for i in range(6):
            await publisher.publish(topic, f"m{i}".encode(), key="k")
        got = await collect(sub, 6, timeout=self.timeout, ack=False)
        assert _texts(got) == [f"m{i}" for i in range(6)]
        for d in got[:3]:
            await d.ack()
        await sub.close()

        sub = await consumer.subscribe(topic, group=group)
        again = await collect(sub, 3, timeout=self.timeout)
        assert _texts(again) == ["m3", "m4", "m5"]
        assert await drain(sub, self.quiet_period) == []
        await sub.close()

        fresh = await (await broker_factory()).subscribe(topic, group=group)
        assert await drain(fresh, self.quiet_period) == []

    async def test_nack_redelivers_at_once(self, broker_factory: BrokerFactory) -> None:
        """``nack()`` gives the message back before the key's later messages."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.nack", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"m0", key="k")
        await broker.publish(topic, b"m1", key="k")
        [first] = await collect(sub, 1, timeout=self.timeout, ack=False, max_messages=1)
        assert first.payload == b"m0"
        await first.nack()
        got = await collect(sub, 2, timeout=self.timeout, max_messages=1)
        assert _texts(got) == ["m0", "m1"]
        assert got[0].delivery_count == 2
        assert got[1].delivery_count == 1

    async def test_nack_with_delay_redelivers_after_the_delay(
        self, broker_factory: BrokerFactory
    ) -> None:
        """``nack(delay)`` redelivers no sooner than about ``delay`` seconds later."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.later", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"m0", key="k")
        [first] = await collect(sub, 1, timeout=self.timeout, ack=False)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await first.nack(self.nack_delay)
        [again] = await collect(sub, 1, timeout=self.nack_delay + self.timeout)
        elapsed = loop.time() - start
        assert again.payload == b"m0"
        assert again.delivery_count == 2
        assert self.nack_delay * 0.8 <= elapsed <= self.nack_delay + self.timeout

    async def test_nack_with_delay_keeps_key_order(self, broker_factory: BrokerFactory) -> None:
        """While a message waits out its ``nack(delay)``, later messages of its key wait too."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.ordernack", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        for i in range(3):
            await broker.publish(topic, f"m{i}".encode(), key="k")
        [first] = await collect(sub, 1, timeout=self.timeout, ack=False, max_messages=1)
        assert first.payload == b"m0"
        await first.nack(self.nack_delay)
        got = await collect(sub, 3, timeout=self.nack_delay + self.timeout, max_messages=1)
        assert _texts(got) == ["m0", "m1", "m2"]
        assert [d.delivery_count for d in got] == [2, 1, 1]

    async def test_pending_nack_of_a_closed_member_does_not_duplicate(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A member that nacks with a delay and leaves causes one redelivery, not two."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.leave", unique_name("g")
        first = await (await broker_factory()).subscribe(topic, group=group)
        await publisher.publish(topic, b"m0", key="k")
        [held] = await collect(first, 1, timeout=self.timeout, ack=False)
        await held.nack(self.nack_delay)
        second = await (await broker_factory()).subscribe(topic, group=group)
        await first.close()
        [again] = await collect(second, 1, timeout=self.nack_delay + self.timeout, ack=False)
        assert again.payload == b"m0"
        # while `second` holds it unacked, past the nack delay, it must not come again
        extra = await drain(second, self.nack_delay + self.quiet_period, ack=False)
        assert [(d.payload, d.delivery_count) for d in extra] == []
        await again.ack()

    async def test_delayed_redelivery_wakes_another_members_waiting_fetch(
        self, broker_factory: BrokerFactory
    ) -> None:
        """A message nacked with a delay by a member that then left reaches the member now
        waiting in ``fetch`` when the delay ends, not when that fetch times out."""
        publisher = await broker_factory()
        topic, group = f"{unique_name()}.wake", unique_name("g")
        first = await (await broker_factory()).subscribe(topic, group=group)
        await publisher.publish(topic, b"m0", key="k")
        [held] = await collect(first, 1, timeout=self.timeout, ack=False)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await held.nack(self.nack_delay)
        second = await (await broker_factory()).subscribe(topic, group=group)
        await first.close()
        got: list[Delivery] = []
        wait = self.nack_delay + self.timeout
        while not got and loop.time() - start < wait:  # fetch may return early, empty
            got = list(await second.fetch(1, wait))
        elapsed = loop.time() - start
        assert [d.payload for d in got] == [b"m0"]
        assert elapsed < self.nack_delay + self.timeout / 2, f"redelivered after {elapsed:.1f}s"
        await got[0].ack()

    async def test_release_gives_back_without_counting(self, broker_factory: BrokerFactory) -> None:
        """``release()`` redelivers at once, ahead of the key's later messages, with the same
        ``delivery_count``: no handler saw it."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.release", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"m0", key="k")
        await broker.publish(topic, b"m1", key="k")
        [first] = await collect(sub, 1, timeout=self.timeout, ack=False, max_messages=1)
        assert (first.payload, first.delivery_count) == (b"m0", 1)
        await first.release()
        got = await collect(sub, 2, timeout=self.timeout, max_messages=1)
        assert [(d.payload, d.delivery_count) for d in got] == [(b"m0", 1), (b"m1", 1)]
        assert await drain(sub, self.quiet_period) == []

    async def test_a_delivery_settles_only_once(self, broker_factory: BrokerFactory) -> None:
        """After ack, nack or release, further settling calls on that delivery change nothing:
        no extra redelivery, and ``delivery_count`` keeps counting real deliveries."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.once", unique_name("g")
        sub = await broker.subscribe(topic, group=group)

        await broker.publish(topic, b"released twice", key="a")
        [d] = await collect(sub, 1, timeout=self.timeout, ack=False)
        await d.release()
        await d.release()
        [again] = await collect(sub, 1, timeout=self.timeout)
        assert (again.payload, again.delivery_count) == (b"released twice", 1)

        await broker.publish(topic, b"nacked then released", key="b")
        [d] = await collect(sub, 1, timeout=self.timeout, ack=False)
        await d.nack()
        await d.release()
        [again] = await collect(sub, 1, timeout=self.timeout)
        assert (again.payload, again.delivery_count) == (b"nacked then released", 2)

        await broker.publish(topic, b"acked then given back", key="c")
        [d] = await collect(sub, 1, timeout=self.timeout, ack=False)
        await d.ack()
        await d.release()
        await d.nack()
        assert await drain(sub, self.quiet_period) == []

    async def test_broker_url_names_the_broker(self, broker_factory: BrokerFactory) -> None:
        """``broker.url`` is a URL with a scheme and no password."""
        broker = await broker_factory()
        parts = urlsplit(broker.url)
        assert parts.scheme
        assert parts.password is None

    async def test_in_progress_then_ack(self, broker_factory: BrokerFactory) -> None:
        """``in_progress()`` is accepted and the acked message is not redelivered."""
        broker = await broker_factory()
        topic, group = f"{unique_name()}.slow", unique_name("g")
        sub = await broker.subscribe(topic, group=group)
        await broker.publish(topic, b"m0")
        [d] = await collect(sub, 1, timeout=self.timeout, ack=False)
        await d.in_progress()
        await d.ack()
        assert await drain(sub, self.quiet_period) == []

    # -- lifecycle ---------------------------------------------------------------------------

    async def test_close_is_idempotent(self, broker_factory: BrokerFactory) -> None:
        """start/close can be repeated; a closed subscription or broker refuses further use."""
        broker = await broker_factory()
        await broker.start()  # already started by the factory
        topic = f"{unique_name()}.close"
        sub = await broker.subscribe(topic, group=unique_name("g"))
        await sub.close()
        await sub.close()
        with pytest.raises(BrokerError):
            await sub.fetch(1, 0.1)
        other = await broker.subscribe(topic, group=unique_name("g"))
        await broker.close()
        await broker.close()
        with pytest.raises(BrokerError):
            await other.fetch(1, 0.1)  # closing the broker closed its subscriptions
        await other.close()
        with pytest.raises(BrokerError):
            await broker.publish(topic, b"late")
