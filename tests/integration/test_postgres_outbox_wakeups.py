"""How a PostgreSQL outbox relay hears adds that other store instances commit: a
notification on a channel of the store's schema, heard on the store's listener connection.

- an add notifies only its own schema's stores (channels are database-wide), long schema
  names included;
- a notification lost while the listener connection was down is made up for: once the
  listener is back, the relay looks at the outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import asyncpg
import pytest

from eventflow import Envelope, Event
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.postgres.outbox import outbox_channel
from eventflow.runtime import relay as relay_module
from eventflow.runtime.relay import OutboxRelay
from eventflow.stores import store_for
from eventflow.testing.broker_contract import eventually
from eventflow.testing.postgres import isolated_schema, postgres_url

pytestmark = pytest.mark.service("postgres")

WITHIN = 5.0  # seconds; with the relay's idle poll raised to a minute, only a wake-up sends


class Sent(Event, type="it.outbox.sent"):
    """Something the outbox sends."""

    n: int


class _Counted(asyncio.Event):
    """An ``outbox.added`` that counts how often it was set, and its waiters."""

    def __init__(self) -> None:
        super().__init__()
        self.times = 0
        self.waiting = 0

    def set(self) -> None:
        self.times += 1
        super().set()

    async def wait(self) -> Literal[True]:
        self.waiting += 1
        try:
            return await super().wait()
        finally:
            self.waiting -= 1


@contextlib.asynccontextmanager
async def _stores(url: str, count: int) -> AsyncIterator[list[PostgresStore]]:
    """``count`` open stores on the schema of ``url``, as many processes would have."""
    async with contextlib.AsyncExitStack() as stack:
        stores = []
        for _ in range(count):
            store = store_for(url)
            assert isinstance(store, PostgresStore)
            await store.open()
            stack.push_async_callback(store.close)
            stores.append(store)
        yield stores


def _message(n: int) -> list[tuple[str, Envelope]]:
    return [("it.outbox.sent", Envelope.create(Sent.event_type, {"n": n}))]


def test_each_schema_has_a_channel_of_its_own_that_postgresql_accepts() -> None:
    short, other = outbox_channel("shop"), outbox_channel("shop2")
    long_a, long_b = outbox_channel("a" * 60), outbox_channel("a" * 59 + "b")
    assert len({short, other, long_a, long_b}) == 4
    assert all(len(c.encode()) <= 63 for c in (short, long_a, long_b))


async def _until(condition: Callable[[], bool], what: str) -> None:
    await eventually(condition, timeout=WITHIN, interval=0.005, message=what)


@pytest.mark.parametrize("prefix", ["ef_test_", "ef_test_" + "long" * 9 + "_"])
async def test_an_add_wakes_the_stores_of_its_schema_and_not_another_schemas(
    prefix: str,
) -> None:
    async with (
        isolated_schema(postgres_url(), prefix=prefix) as x_url,
        isolated_schema(postgres_url(), prefix=prefix) as y_url,
        _stores(x_url, 2) as (x_writer, x_relay),
        _stores(y_url, 2) as (y_writer, y_relay),
    ):
        x_relay.outbox.added = x_heard = _Counted()
        y_relay.outbox.added = y_heard = _Counted()
        await x_writer.outbox.add(_message(1))
        await y_writer.outbox.add(_message(2))  # committed after x's
        await _until(lambda: x_heard.times >= 1 and y_heard.times >= 1, "both heard")
        # One listener connection receives in commit order: had y's listener followed x's
        # channel, x's notification would have been counted before y's own.
        assert y_heard.times == 1
        assert x_heard.times >= 1


@contextlib.asynccontextmanager
async def _relaying(store: PostgresStore) -> AsyncIterator[MemoryBroker]:
    """An outbox relay on ``store`` sending to a memory broker, while the block runs."""
    broker = MemoryBroker()
    await broker.start()
    relay = OutboxRelay(store, broker)
    task = asyncio.ensure_future(relay.run())
    try:
        yield broker
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await broker.close()


async def _terminate(conn: Any) -> None:
    """End the server session of ``conn`` (as a server restart or a failover would)."""
    pid = conn.get_server_pid()
    admin = await asyncpg.connect(postgres_url())
    try:
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()


def _gate(store: PostgresStore, opened: asyncio.Event) -> Callable[..., Awaitable[Any]]:
    """``store.db.connect``, holding new listener connections until ``opened`` is set."""
    connect = store.db.connect

    async def gated(purpose: str, **kwargs: Any) -> Any:
        if purpose.startswith("listen"):
            await opened.wait()
        return await connect(purpose, **kwargs)

    return gated


async def test_the_relay_looks_at_the_outbox_once_its_listener_is_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay_module, "_IDLE_POLL", 60.0)
    async with isolated_schema(postgres_url()) as url, _stores(url, 3) as stores:
        holder, writer, observer = stores
        holder.outbox.added = idle = _Counted()
        observer.outbox.added = observed = _Counted()
        async with _relaying(holder) as broker:
            sub = await broker.subscribe("it.outbox.sent", group="it-outbox")
            await writer.outbox.add(_message(1))
            assert await _sent(sub) == [1]  # heard at once: the relay's poll is a minute now
            await _until(lambda: idle.waiting > 0, "the relay waits for adds")
            await _listener_lost_while(holder, observed, lambda: writer.outbox.add(_message(2)))
            assert await _sent(sub) == [2]
            await sub.close()


async def _listener_lost_while(
    store: PostgresStore, observed: _Counted, add: Callable[[], Awaitable[None]]
) -> None:
    """Kill the listener connection of ``store`` and run ``add`` before it connects again,
    then let it; ``observed``: the ``added`` of another store on the schema."""
    back = asyncio.Event()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store.db, "connect", _gate(store, back))
        await _terminate(store._sequencer.listener)
        await _until(lambda: store._sequencer.listener is None, "the listener is lost")
        before = observed.times
        await add()  # notified while nobody in store listens
        # Once another session has read the notification, a new LISTEN starts past it (a
        # new listener may otherwise still get notifications committed just before it).
        await _until(lambda: observed.times > before, "the observer heard the add")
        back.set()
        await _until(lambda: store._sequencer.listener is not None, "the listener is back")


async def _sent(sub: Any) -> list[int]:
    """The ``n`` of the next messages the relay sent (acked), waiting up to ``WITHIN``."""
    got = await sub.fetch(10, WITHIN)
    for delivery in got:
        await delivery.ack()
    return [Envelope.from_bytes(d.payload).data["n"] for d in got]
