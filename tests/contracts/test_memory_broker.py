"""The memory broker against the Broker contract, plus what only the memory broker offers:
bounded groups with backpressure, named hubs and partition handover between members."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from eventflow.adapters.memory.broker import MemoryBroker, MemoryBrokerConfig
from eventflow.adapters.memory.groups import MemorySubscription
from eventflow.brokers import open_broker
from eventflow.errors import BackpressureError, ConfigurationError, MessageRefusedError
from eventflow.ports import Delivery, Subscription
from eventflow.testing.broker_contract import (
    BrokerContract,
    BrokerFactory,
    broker_pool,
    collect,
    drain,
    eventually,
    unique_name,
)
from eventflow.testing.broker_contract.lag import Die

MemoryFactory = Callable[..., MemoryBroker]


class TestMemoryBroker(BrokerContract):
    """The Broker contract on brokers sharing one fresh memory hub per test."""

    @pytest.fixture
    async def broker_factory(self) -> AsyncIterator[BrokerFactory]:
        """Brokers on a hub of their own, so tests do not see each other's groups."""
        name = unique_name("hub")
        async with broker_pool(lambda: MemoryBroker(MemoryBrokerConfig(name=name))) as factory:
            yield factory

    @contextlib.asynccontextmanager
    async def hold_and_die(
        self, broker_factory: BrokerFactory, pattern: str, group: str, count: int
    ) -> AsyncIterator[Die]:
        """The hub lives in this process, so a member dies here: its subscription is
        abandoned as when its process goes (nothing acked, its messages go back)."""
        sub = await (await broker_factory()).subscribe(pattern, group=group)

        async def die() -> None:
            await collect(sub, count, timeout=self.timeout, ack=False)
            assert isinstance(sub, MemorySubscription)
            sub.abandon()

        yield die


@pytest.fixture
async def memory_broker() -> AsyncIterator[MemoryFactory]:
    """Build (unstarted) memory brokers on one fresh hub with the given config fields."""
    hub = unique_name("hub")
    brokers: list[MemoryBroker] = []

    def make(**fields: Any) -> MemoryBroker:
        broker = MemoryBroker(MemoryBrokerConfig(name=hub, **fields))
        brokers.append(broker)
        return broker

    try:
        yield make
    finally:
        for broker in reversed(brokers):
            await broker.close()


async def _started(broker: MemoryBroker) -> MemoryBroker:
    await broker.start()
    return broker


# -- backpressure ----------------------------------------------------------------------------


async def test_full_group_makes_publisher_wait_then_raise(memory_broker: MemoryFactory) -> None:
    """A group at ``max_pending`` unacked messages blocks the publisher, then raises."""
    broker = await _started(memory_broker(max_pending=2, publish_timeout=0.2))
    topic, group = f"{unique_name()}.bp", unique_name("g")
    sub = await broker.subscribe(topic, group=group)
    await broker.publish(topic, b"m0")
    await broker.publish(topic, b"m1")
    assert broker.group_sizes()[(group, topic)] == 2

    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(BackpressureError, match=group):
        await broker.publish(topic, b"m2")
    assert 0.15 <= loop.time() - start < 5.0
    assert broker.group_sizes()[(group, topic)] == 2, "the refused message was not queued"

    # in-flight but unacked messages still count against the bound
    held = await collect(sub, 2, ack=False)
    with pytest.raises(BackpressureError):
        await broker.publish(topic, b"m2")
    for d in held:
        await d.ack()
    assert broker.group_sizes()[(group, topic)] == 0
    await broker.publish(topic, b"m2")
    assert [d.payload for d in await collect(sub, 1)] == [b"m2"]


@pytest.mark.parametrize("max_pending", [2, 16])
async def test_waiting_publisher_proceeds_once_a_consumer_acks(
    memory_broker: MemoryFactory, max_pending: int
) -> None:
    """A publisher blocked by a full group continues as soon as an ack makes room."""
    broker = await _started(memory_broker(max_pending=max_pending, publish_timeout=2.0))
    topic, group = f"{unique_name()}.bp", unique_name("g")
    sub = await broker.subscribe(topic, group=group)
    for i in range(max_pending):
        await broker.publish(topic, f"m{i}".encode(), key="k")
    async with asyncio.TaskGroup() as tg:
        blocked = tg.create_task(broker.publish(topic, b"last", key="k"))
        done, _ = await asyncio.wait({blocked}, timeout=0.3)
        assert not done, "the publisher should wait while the group is full"
        [first] = await collect(sub, 1, ack=False, max_messages=1)
        assert first.payload == b"m0"
        await first.ack()
        await asyncio.wait_for(blocked, timeout=5.0)
    got = await collect(sub, max_pending)
    assert [d.payload for d in got] == [f"m{i}".encode() for i in range(1, max_pending)] + [b"last"]


async def test_full_group_does_not_block_other_groups_publishes(
    memory_broker: MemoryFactory,
) -> None:
    """Backpressure is per group: topics not routed to the full group publish freely."""
    broker = await _started(memory_broker(max_pending=1, publish_timeout=0.2))
    root = unique_name()
    await broker.subscribe(f"{root}.full", group=unique_name("g"))
    free = await broker.subscribe(f"{root}.free", group=unique_name("g"))
    await broker.publish(f"{root}.full", b"fills it")
    with pytest.raises(BackpressureError):
        await broker.publish(f"{root}.full", b"refused")
    for i in range(3):
        await broker.publish(f"{root}.free", f"m{i}".encode())
        assert [d.payload for d in await collect(free, 1)] == [f"m{i}".encode()]


async def test_refused_publish_reaches_no_group(memory_broker: MemoryFactory) -> None:
    """A message refused because one target group is full is not left in the others."""
    broker = await _started(memory_broker(max_pending=1, publish_timeout=0.2))
    topic = f"{unique_name()}.bp"
    roomy, full = unique_name("g-roomy"), unique_name("g-full")
    roomy_sub = await broker.subscribe(topic, group=roomy)
    await broker.subscribe(topic, group=full)
    await broker.publish(topic, b"first")
    [got] = await collect(roomy_sub, 1)  # acked: room again in one group, not the other
    assert got.payload == b"first"
    with pytest.raises(BackpressureError, match=full):
        await broker.publish(topic, b"refused")
    sizes = broker.group_sizes()
    assert sizes[(roomy, topic)] == 0 and sizes[(full, topic)] == 1
    assert await roomy_sub.fetch(10, 0.05) == []


def test_config_is_validated() -> None:
    """Partitions, max_pending and max_message_bytes below 1 are refused."""
    with pytest.raises(ConfigurationError):
        MemoryBroker(MemoryBrokerConfig(partitions=0))
    with pytest.raises(ConfigurationError):
        MemoryBroker(MemoryBrokerConfig(max_pending=0))
    with pytest.raises(ConfigurationError):
        MemoryBroker(MemoryBrokerConfig(max_message_bytes=0))


# -- limits ----------------------------------------------------------------------------------


async def test_max_message_bytes_is_configurable(memory_broker: MemoryFactory) -> None:
    """A payload of exactly ``max_message_bytes`` passes, one byte more is refused, and the
    default is 1 MiB, as on NATS and Kafka."""
    assert MemoryBrokerConfig().max_message_bytes == 1024 * 1024
    broker = await _started(memory_broker(max_message_bytes=100))
    topic = f"{unique_name()}.lim"
    sub = await broker.subscribe(topic, group=unique_name("g"))
    with pytest.raises(MessageRefusedError, match="max_message_bytes=100"):
        await broker.publish(topic, b"x" * 101)
    await broker.publish(topic, b"x" * 100)
    assert [len(d.payload) for d in await collect(sub, 1)] == [100]


async def test_route_cache_stays_bounded_with_many_distinct_topics(
    memory_broker: MemoryFactory,
) -> None:
    """Topics made per id (``tenant-<n>.created``) do not grow the hub's route cache
    without end, and every message still reaches the group that matches it."""
    broker = await _started(memory_broker())
    root = unique_name()
    sub = await broker.subscribe(f"{root}.*.created", group=unique_name("g"))
    count = 6000  # past the cache's bound of 4096 topics
    for i in range(count):
        await broker.publish(f"{root}.t{i}.created", b"x")
        await broker.publish(f"{root}.t{i}.ignored", b"x")  # routed nowhere, cached too
    hub = broker._live_hub()
    assert 0 < len(hub.routes) <= 4096
    got = await collect(sub, count, max_messages=500)
    assert len({d.topic for d in got}) == count
    assert await drain(sub, 0.1) == []


# -- hubs ------------------------------------------------------------------------------------


async def test_same_memory_url_shares_a_hub_and_other_names_do_not() -> None:
    """``memory://a`` brokers talk to each other; ``memory://b`` is a separate world."""
    a, b = unique_name("hub"), unique_name("hub")
    pub, peer, stranger = (
        open_broker(f"memory://{a}"),
        open_broker(f"memory://{a}"),
        open_broker(f"memory://{b}"),
    )
    assert isinstance(pub, MemoryBroker)
    assert pub.url == f"memory://{a}"
    try:
        for broker in (pub, peer, stranger):
            await broker.start()
        topic, group = f"{unique_name()}.hub", unique_name("g")
        near = await peer.subscribe(topic, group=group)
        far = await stranger.subscribe(topic, group=group)
        await pub.publish(topic, b"hello", key="k")
        assert [d.payload for d in await collect(near, 1)] == [b"hello"]
        assert await drain(far, 0.3) == []
        await stranger.publish(topic, b"local")
        assert [d.payload for d in await collect(far, 1)] == [b"local"]
        assert await drain(near, 0.3) == []
    finally:
        for broker in (pub, peer, stranger):
            await broker.close()


async def test_hub_lives_while_one_of_its_brokers_is_open() -> None:
    """Groups survive while any broker of the hub is open and go with the last one."""
    hub = unique_name("hub")
    topic, group = f"{unique_name()}.life", unique_name("g")
    keeper, member = open_broker(f"memory://{hub}"), open_broker(f"memory://{hub}")
    await keeper.start()
    await member.start()
    await member.subscribe(topic, group=group)
    await member.close()
    await keeper.publish(topic, b"kept")
    await keeper.close()  # last broker: the hub, its group and the message go away

    again = open_broker(f"memory://{hub}")
    await again.start()
    try:
        sub = await again.subscribe(topic, group=group)
        assert await drain(sub, 0.3) == []
        await again.publish(topic, b"new")
        assert [d.payload for d in await collect(sub, 1)] == [b"new"]
    finally:
        await again.close()


# -- where new groups begin -------------------------------------------------------------------


async def test_start_earliest_begins_at_the_newest_retain_messages_of_the_hub(
    memory_broker: MemoryFactory,
) -> None:
    """The hub keeps the newest ``retain`` messages of every topic, acked or not: a group
    created with ``start="earliest"`` begins with those its pattern matches, in order."""
    broker = await _started(memory_broker(retain=3))
    root = unique_name()
    topic = f"{root}.cmd"
    seen = await broker.subscribe(topic, group=unique_name("g"))
    for i in range(4):
        await broker.publish(topic, f"m{i}".encode(), key="k")
    await broker.publish(f"{root}.other", b"not matched", key="k")
    assert [d.payload for d in await collect(seen, 4)] == [b"m0", b"m1", b"m2", b"m3"]
    late = await broker.subscribe(topic, group=unique_name("g"), start="earliest")
    assert [d.payload for d in await collect(late, 2)] == [b"m2", b"m3"]  # m0, m1: over 3
    assert await drain(late, 0.2) == []


async def test_retain_bytes_bounds_the_payload_the_hub_keeps(
    memory_broker: MemoryFactory,
) -> None:
    """``retain_bytes`` bounds the kept payloads as well as ``retain`` their count: a
    ``start="earliest"`` group begins with the newest messages that fit in it."""
    broker = await _started(memory_broker(retain=100, retain_bytes=25))
    topic = f"{unique_name()}.cmd"
    for i in range(4):
        await broker.publish(topic, b"%d" % i + b"x" * 9, key="k")  # 10 bytes each
    late = await broker.subscribe(topic, group=unique_name("g"), start="earliest")
    assert [d.payload[:1] for d in await collect(late, 2)] == [b"2", b"3"]  # 20 of 25 bytes
    assert await drain(late, 0.2) == []


async def test_retain_zero_keeps_nothing_for_new_groups(memory_broker: MemoryFactory) -> None:
    """``retain=0``: a group created with ``start="earliest"`` begins with the next
    message, as with ``"latest"``."""
    broker = await _started(memory_broker(retain=0))
    topic = f"{unique_name()}.cmd"
    await broker.publish(topic, b"before")
    sub = await broker.subscribe(topic, group=unique_name("g"), start="earliest")
    await broker.publish(topic, b"after")
    assert [d.payload for d in await collect(sub, 1)] == [b"after"]
    assert await drain(sub, 0.2) == []


async def test_a_declared_group_holds_messages_within_max_pending(
    memory_broker: MemoryFactory,
) -> None:
    """A group declared without members is bounded like any other: a publisher finding it
    full waits, then gets ``BackpressureError``."""
    broker = await _started(memory_broker(max_pending=2, publish_timeout=0.1))
    topic, group = f"{unique_name()}.cmd", unique_name("g")
    assert await broker.declare(topic, group=group) is False
    await broker.publish(topic, b"m0")
    await broker.publish(topic, b"m1")
    with pytest.raises(BackpressureError, match=group):
        await broker.publish(topic, b"m2")
    sub = await broker.subscribe(topic, group=group)
    assert [d.payload for d in await collect(sub, 2)] == [b"m0", b"m1"]


# -- partition handover ----------------------------------------------------------------------


async def test_handover_waits_until_the_previous_owner_settles(
    memory_broker: MemoryFactory,
) -> None:
    """A joining member gets no message of a key another member still holds unacked."""
    broker = await _started(memory_broker(partitions=8))
    topic, group = f"{unique_name()}.hand", unique_name("g")
    first = await broker.subscribe(topic, group=group)
    keys = [f"k{i}" for i in range(16)]
    for key in keys:
        await broker.publish(topic, f"{key}:0".encode(), key=key)
    held = await collect(first, len(keys), ack=False, max_messages=100)
    for key in keys:
        await broker.publish(topic, f"{key}:1".encode(), key=key)

    second = await broker.subscribe(topic, group=group)  # takes over half the partitions
    assert await drain(second, 0.3, ack=False) == [], "every key is still held by `first`"
    for d in held:
        await d.ack()
    got_second = await drain(second, 0.3)
    got_first = await drain(first, 0.3)
    assert got_second, "the handed-over partitions now reach `second`"
    assert got_first, "`first` keeps the partitions still assigned to it"
    payloads = sorted(d.payload.decode() for d in [*got_first, *got_second])
    assert payloads == sorted(f"{key}:1" for key in keys)
    assert not {d.key for d in got_first} & {d.key for d in got_second}


async def test_no_key_is_held_by_two_members_while_members_come_and_go(
    memory_broker: MemoryFactory,
) -> None:
    """Under joins, leaves (with unacked messages) and slow handlers, a key is only ever held
    by one member at a time, and each key's messages are acked once each, in order."""
    rng = random.Random(1234)
    broker = await _started(memory_broker(partitions=4))
    topic, group = f"{unique_name()}.churn", unique_name("g")
    keys = [f"k{i}" for i in range(10)]
    per_key = 30
    holders: dict[str, dict[str, int]] = defaultdict(dict)  # key -> member -> unacked count
    violations: list[str] = []
    acked: dict[str, list[int]] = defaultdict(list)

    async def member(name: str, sub: Subscription, stop: asyncio.Event) -> None:
        mine: list[Delivery] = []
        try:
            while not stop.is_set():
                for d in await sub.fetch(5, 0.05):
                    key = d.key or ""
                    others = [m for m in holders[key] if m != name]
                    if others:
                        violations.append(f"{key} fetched by {name} while held by {others}")
                    holders[key][name] = holders[key].get(name, 0) + 1
                    mine.append(d)
                while mine and not stop.is_set():
                    d = mine.pop(0)
                    await asyncio.sleep(rng.random() * 0.004)  # a handler doing some work
                    if stop.is_set():
                        mine.insert(0, d)
                        break
                    key = d.key or ""
                    acked[key].append(int(d.payload.decode().split(":")[1]))
                    await d.ack()
                    holders[key][name] -= 1
                    if not holders[key][name]:
                        del holders[key][name]
        finally:
            await sub.close()  # the unacked deliveries in `mine` go back to the group
            for key in list(holders):
                holders[key].pop(name, None)

    total = len(keys) * per_key
    async with asyncio.TaskGroup() as tg:
        stops: dict[str, asyncio.Event] = {}

        async def join(name: str) -> None:
            stops[name] = asyncio.Event()
            sub = await broker.subscribe(topic, group=group)
            tg.create_task(member(name, sub, stops[name]))

        await join("m0")
        for seq in range(per_key):
            for key in keys:
                await broker.publish(topic, f"{key}:{seq}".encode(), key=key)
            if seq == 5:
                await join("m1")
            elif seq == 10:
                await join("m2")
            elif seq == 15:
                stops["m0"].set()
            elif seq == 20:
                await join("m3")
            elif seq == 25:
                stops["m1"].set()
            await asyncio.sleep(0.01)  # let the members interleave with publishing
        try:
            await eventually(
                lambda: sum(len(v) for v in acked.values()) >= total,
                timeout=30,
                message="all messages acked",
            )
        finally:
            for stop in stops.values():
                stop.set()

    assert violations == []
    assert acked == {key: list(range(per_key)) for key in keys}
    assert broker.group_sizes()[(group, topic)] == 0


async def test_a_partition_handed_to_a_new_member_wakes_that_member() -> None:
    """After a rebalance, new messages wake the member a partition is assigned to, not the
    member that owned it before (which would leave the new one waiting out its timeout)."""
    broker = MemoryBroker(MemoryBrokerConfig(name="ut-stale-owner", partitions=2))
    await broker.start()
    try:
        first = await broker.subscribe("so.t", group="g")
        for key in "ab":
            await broker.publish("so.t", b"1", key=key)
        for delivery in await first.fetch(10, 0.1):
            await delivery.ack()  # `first` owned both partitions
        second = await broker.subscribe("so.t", group="g")  # one partition moves to it
        fetches = [asyncio.create_task(m.fetch(10, 3.0)) for m in (first, second)]
        await asyncio.sleep(0.05)
        for key in "abcdefgh":
            await broker.publish("so.t", b"2", key=key)
        async with asyncio.timeout(1.0):
            got = await asyncio.gather(*fetches)
        assert sum(len(batch) for batch in got) == 8
        assert all(got), "each member gets its partition's messages"
    finally:
        await broker.close()


async def test_concurrent_fetches_on_one_subscription_are_each_woken() -> None:
    """One fetch timing out must not keep another, still waiting, from being woken."""
    broker = MemoryBroker(MemoryBrokerConfig(name="ut-two-fetches"))
    await broker.start()
    try:
        sub = await broker.subscribe("tf.t", group="g")
        long = asyncio.create_task(sub.fetch(10, 3.0))
        assert await sub.fetch(10, 0.1) == []
        await broker.publish("tf.t", b"1")
        async with asyncio.timeout(1.0):
            assert len(await long) == 1
    finally:
        await broker.close()


def test_memory_urls_take_the_config_options_and_refuse_others() -> None:
    broker = open_broker("memory://hub-x?partitions=2&max_pending=5&max_message_bytes=100&retain=0")
    assert isinstance(broker, MemoryBroker)
    assert broker.config == MemoryBrokerConfig(
        name="hub-x", partitions=2, max_pending=5, max_message_bytes=100, retain=0
    )
    assert MemoryBrokerConfig().retain == 10_000
    with pytest.raises(ConfigurationError, match="unknown option 'partition'"):
        open_broker("memory://?partition=2")
    with pytest.raises(ConfigurationError, match="max_pending='lots'"):
        open_broker("memory://?max_pending=lots")
