"""Messages the broker refuses for good (too large): a handler's outgoing message
dead-letters only the message it handled, and a poison outbox row is parked, while the
messages behind them flow. On the memory broker (its ``max_message_bytes``) and on a real
NATS server (its ``max_payload``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path

import pytest

from eventflow import App, ConfigurationError, Context, Event, RetryPolicy, subscribe
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig
from eventflow.adapters.nats import NatsBroker, NatsBrokerConfig
from eventflow.ports import Broker, DeadLetter
from eventflow.runtime.relay import OUTBOX_GROUP, PARK_AFTER
from eventflow.testing import unique_name

Wait = Callable[..., Awaitable[None]]
LIMIT = 4096  # the memory broker's max_message_bytes in these tests
NATS_MAX_PAYLOAD = 1024 * 1024  # the server's default max_payload


class RfOrder(Event, type="it.rf.order"):
    """Work in; ``big`` makes its handler publish a message over the broker's limit."""

    n: int
    big: bool = False


class RfShipped(Event, type="it.rf.shipped"):
    """What the handler publishes."""

    n: int
    note: str = ""


@pytest.fixture(params=["memory", pytest.param("nats", marks=pytest.mark.service("nats"))])
async def make_broker(
    request: pytest.FixtureRequest, broker_name: str
) -> AsyncIterator[Callable[[], Broker]]:
    """Brokers (one per app) on one hub or server, and the size a refused message needs."""
    if request.param == "memory":
        keep = MemoryBroker(MemoryBrokerConfig(name=broker_name, max_message_bytes=LIMIT))
        await keep.start()

        def memory() -> Broker:
            return MemoryBroker(MemoryBrokerConfig(name=broker_name, max_message_bytes=LIMIT))

        memory.oversize = LIMIT + 1  # type: ignore[attr-defined]
        yield memory
        await keep.close()
        return
    url = request.getfixturevalue("nats_url")
    stream = unique_name("RF").upper()

    def nats() -> Broker:
        return NatsBroker(NatsBrokerConfig.from_url(f"{url}?stream={stream}&partitions=2"))

    nats.oversize = NATS_MAX_PAYLOAD + 1  # type: ignore[attr-defined]
    yield nats


async def test_a_refused_outgoing_message_dead_letters_only_its_own_message(
    make_broker: Callable[[], Broker], waiter: Wait
) -> None:
    oversize: int = make_broker.oversize  # type: ignore[attr-defined]
    handled: list[int] = []
    shipped: list[int] = []

    @subscribe("it.rf.order", group="orders", retry=RetryPolicy(3, initial_delay=0.01))
    async def ship(event: RfOrder, ctx: Context) -> None:
        handled.append(event.n)
        note = "x" * oversize if event.big else ""
        await ctx.publish(RfShipped(n=event.n, note=note))

    @subscribe("it.rf.shipped", group="shipping")
    async def record(event: RfShipped) -> None:
        shipped.append(event.n)

    app = App("it-rf", broker=make_broker(), handlers=[ship, record])
    async with app:
        for n in range(5):
            await app.publish(RfOrder(n=n, big=n == 1), key="one-key")
        await waiter(lambda: sorted(shipped) == [0, 2, 3, 4], what="the others of the key")
        [letter] = await app.dead_letters.list()
        assert letter.group == "orders"
        assert letter.reason == "publish-refused"
        assert "MessageRefusedError" in letter.error
        assert letter.attempts == 1  # refused for good: not retried
        assert handled.count(1) == 1
        assert shipped == [0, 2, 3, 4]  # in key order, the refused one's successors too


async def test_a_poison_outbox_row_is_parked_and_the_next_rows_relay(
    make_broker: Callable[[], Broker], tmp_path: Path, waiter: Wait
) -> None:
    oversize: int = make_broker.oversize  # type: ignore[attr-defined]
    shipped: list[int] = []

    @subscribe("it.rf.order", group="orders")
    async def ship(event: RfOrder, ctx: Context) -> None:
        async with ctx.transaction():  # the outgoing message goes through the outbox
            await ctx.publish(RfShipped(n=event.n, note="x" * oversize if event.big else ""))

    @subscribe("it.rf.shipped", group="shipping")
    async def record(event: RfShipped) -> None:
        shipped.append(event.n)

    store = f"sqlite:///{tmp_path / 'rf.db'}"
    app = App("it-rf-outbox", broker=make_broker(), store=store, handlers=[ship, record])
    async with app:
        for n in range(5):
            await app.publish(RfOrder(n=n, big=n == 1), key="one-key")
        await waiter(lambda: sorted(shipped) == [0, 2, 3, 4], what="the rows behind the poison")
        assert await app.store.outbox.pending() == []
        [letter] = await app.dead_letters.list()
        assert letter.group == OUTBOX_GROUP
        assert letter.reason == "publish-refused"
        assert letter.attempts == PARK_AFTER
        assert letter.topic == "it.rf.shipped"
        assert len(letter.payload) > oversize
        stats = app.stats()
        assert stats["orders:it.rf.order"]["handled"] == 5  # the handlers themselves all succeeded
        assert await app.dead_letters.purge([letter.id]) == 1


async def test_a_parked_message_is_replayed_to_every_group(
    broker_url: str, tmp_path: Path, waiter: Wait
) -> None:
    """A relay parks a message that reached no group: its replay is for all of them (a
    consumer group's letter goes back to that group only)."""
    got: dict[str, list[int]] = {"a": [], "b": []}

    def handler(group: str) -> Callable[..., Awaitable[None]]:
        @subscribe("it.rf.shipped", group=group)
        async def record(event: RfShipped) -> None:
            got[group].append(event.n)

        return record

    store = f"sqlite:///{tmp_path / 'rf.db'}"
    app = App("it-rf-replay", broker=broker_url, store=store, handlers=[handler("a"), handler("b")])
    async with app:
        env = await app.publish(RfShipped(n=9))
        await waiter(lambda: got == {"a": [9], "b": [9]})
        letter = DeadLetter(
            id="parked-1",
            topic="it.rf.shipped",
            group=OUTBOX_GROUP,
            payload=env.to_bytes().replace(env.id.encode(), b"0" * len(env.id)),
            error="MessageRefusedError: too large (then fixed)",
            attempts=PARK_AFTER,
            failed_at=datetime.now(UTC),
            reason="publish-refused",
        )
        await app.store.dead_letters.add(letter)
        assert [d.id for d in await app.dead_letters.list()] == ["parked-1"]
        assert await app.dead_letters.replay(["parked-1"]) == 1
        await waiter(lambda: got == {"a": [9, 9], "b": [9, 9]}, what="both groups got it")


class _NamingBroker(MemoryBroker):
    """A memory broker that cannot name one topic, as Kafka cannot name ``a/b`` (raising a
    ConfigurationError, as a third-party adapter might, not MessageRefusedError)."""

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if topic == "tenant/42.orders":
            raise ConfigurationError(f"topic {topic!r} has a character this broker refuses")
        await super().publish(topic, payload, key=key, headers=headers)


@pytest.mark.parametrize("through_outbox", [False, True])
async def test_a_topic_the_broker_can_never_send_to_is_a_refusal(
    through_outbox: bool, broker_name: str, tmp_path: Path, waiter: Wait
) -> None:
    """A configuration error from the broker's publish can never pass: the handled message
    is dead-lettered (or the outbox row parked) and the key's next messages flow, instead of
    the message being given back for ever."""
    shipped: list[int] = []

    @subscribe("it.rf.order", group="orders", retry=2)
    async def ship(event: RfOrder, ctx: Context) -> None:
        topic = "tenant/42.orders" if event.n == 1 else "it.rf.shipped"
        if through_outbox:
            async with ctx.transaction():
                await ctx.publish(RfShipped(n=event.n), topic=topic)
        else:
            await ctx.publish(RfShipped(n=event.n), topic=topic)

    @subscribe("it.rf.shipped", group="shipping")
    async def record(event: RfShipped) -> None:
        shipped.append(event.n)

    broker = _NamingBroker(MemoryBrokerConfig(name=broker_name))
    store = f"sqlite:///{tmp_path / 'rf.db'}"
    app = App("it-rf-naming", broker=broker, store=store, handlers=[ship, record])
    async with app:
        for n in range(4):
            await app.publish(RfOrder(n=n), key="one-key")
        await waiter(lambda: shipped == [0, 2, 3], what="the key's other messages")
        [letter] = await app.dead_letters.list()
        assert letter.reason == "publish-refused"
        assert letter.group == (OUTBOX_GROUP if through_outbox else "orders")
        assert app.stats()["orders:it.rf.order"]["given_back"] == 0
