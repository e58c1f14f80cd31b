"""How often the outbox relay looks at the outbox, on memory, SQLite and PostgreSQL.

- a relay sending messages one at a time looks once per message: after a look that did not
  fill its batch it waits for ``outbox.added`` instead of looking again;
- that wait misses nothing: a message added while the relay sends the one before it is
  sent without the relay's idle poll (raised to a minute here);
- SQLite: a relay woken by other connections' commits wakes only for outbox rows (its own
  deletes, dedup entries, heartbeats leave the outbox's high-water mark where it was).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from eventflow import Envelope, Event
from eventflow.adapters.memory import MemoryBroker
from eventflow.ports import Broker, OutboxMessage, Store
from eventflow.runtime import relay as relay_module
from eventflow.runtime.relay import OutboxRelay
from eventflow.stores import store_for
from eventflow.testing.broker_contract import eventually, unique_name
from eventflow.testing.postgres import isolated_schema, postgres_url

WITHIN = 10.0  # seconds; the relay's idle poll is raised to a minute: only a wake-up sends


class Looked(Event, type="it.looks.sent"):
    """Something the outbox sends."""

    n: int


@contextlib.asynccontextmanager
async def _store_urls(kind: str, tmp_path: Path) -> AsyncIterator[str]:
    if kind == "postgres":
        async with isolated_schema(postgres_url()) as url:
            yield url
    elif kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'looks.db'}"
    else:
        yield "memory://"


@contextlib.asynccontextmanager
async def _stores(url: str, count: int) -> AsyncIterator[list[Store]]:
    """``count`` open stores on ``url`` (one for memory), as many processes would have."""
    async with contextlib.AsyncExitStack() as stack:
        stores: list[Store] = []
        for _ in range(count):
            store = store_for(url)
            await store.open()
            stack.push_async_callback(store.close)
            stores.append(store)
        yield stores


class _Looks:
    """Counts the relay's looks at ``store.outbox`` (and the empty ones)."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.looks = 0
        self.empty = 0
        pending = store.outbox.pending

        async def counted(limit: int = 100) -> list[OutboxMessage]:
            batch = await pending(limit)
            self.looks += 1
            self.empty += not batch
            return batch

        monkeypatch.setattr(store.outbox, "pending", counted)


@contextlib.asynccontextmanager
async def _relaying(store: Store, broker: Broker) -> AsyncIterator[OutboxRelay]:
    relay = OutboxRelay(store, broker)
    task = asyncio.ensure_future(relay.run())
    try:
        yield relay
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _message(topic: str, n: int) -> list[tuple[str, Envelope]]:
    return [(topic, Envelope.create(Looked.event_type, {"n": n}))]


async def _received(sub: Any, count: int) -> list[int]:
    got: list[int] = []
    while len(got) < count:
        batch = await sub.fetch(count - len(got), WITHIN)
        assert batch, f"only {got} arrived within {WITHIN}s"
        for delivery in batch:
            await delivery.ack()
            got.append(Envelope.from_bytes(delivery.payload).data["n"])
    return got


async def _until(condition: Callable[[], bool], what: str) -> None:
    await eventually(condition, timeout=WITHIN, interval=0.005, message=what)


_KINDS = ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.service("postgres"))]


@pytest.mark.parametrize("kind", _KINDS)
async def test_a_relay_sending_one_message_at_a_time_looks_once_per_message(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_module, "_IDLE_POLL", 60.0)
    topic, hops = unique_name("it.looks"), 20
    async with _store_urls(kind, tmp_path) as url, _stores(url, 1) as (store,):
        looks = _Looks(store, monkeypatch)
        broker = MemoryBroker()
        await broker.start()
        try:
            sub = await broker.subscribe(topic, group=unique_name("g"))
            async with _relaying(store, broker) as relay:
                for n in range(hops):
                    async with store.transaction() as tx:
                        await store.outbox.add(_message(topic, n), tx=tx)
                    assert await _received(sub, 1) == [n]
                await _until(lambda: relay.sent == hops, "the relay removed what it sent")
            # One look per message, and the first look of all. A look that finds nothing
            # follows a wake-up with nothing new (rare); one after every message (a look
            # again after each short batch) would make ``hops`` of them.
            assert looks.empty <= hops // 4, f"{looks.empty} of {looks.looks} looks were empty"
            assert looks.looks - looks.empty == hops  # the positive control: each was seen
            await sub.close()
        finally:
            await broker.close()


class _Held:
    """A memory broker whose first publish waits until ``release`` is set."""

    def __init__(self, broker: MemoryBroker) -> None:
        self._broker = broker
        self.publishing = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._broker, name)

    async def publish(self, *args: Any, **kwargs: Any) -> None:
        if not self.publishing.is_set():
            self.publishing.set()
            await self.release.wait()
        await self._broker.publish(*args, **kwargs)


@pytest.mark.parametrize("kind", _KINDS)
async def test_a_message_added_while_the_relay_sends_is_sent_without_its_poll(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_module, "_IDLE_POLL", 60.0)
    topic = unique_name("it.looks")
    shared = kind != "memory"  # a memory store is one process's: the writer is itself
    async with _store_urls(kind, tmp_path) as url, _stores(url, 1 + shared) as stores:
        store, writer = stores[0], stores[-1]
        broker = MemoryBroker()
        await broker.start()
        held = _Held(broker)
        try:
            sub = await broker.subscribe(topic, group=unique_name("g"))
            async with _relaying(store, held):  # type: ignore[arg-type]
                await store.outbox.add(_message(topic, 1))
                await held.publishing.wait()  # the relay sends message 1 (its look is over)
                await writer.outbox.add(_message(topic, 2))
                held.release.set()
                assert await _received(sub, 2) == [1, 2]
            await sub.close()
        finally:
            await broker.close()


async def test_sqlite_a_waiting_relay_wakes_for_outbox_rows_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_module, "_IDLE_POLL", 60.0)
    topic = unique_name("it.looks")
    url = f"sqlite:///{tmp_path / 'looks.db'}"
    async with _stores(url, 2) as (store, other):
        looks = _Looks(store, monkeypatch)
        broker = MemoryBroker()
        await broker.start()
        try:
            sub = await broker.subscribe(topic, group=unique_name("g"))
            async with _relaying(store, broker) as relay:
                await other.outbox.add(_message(topic, 1))
                assert await _received(sub, 1) == [1]
                await _until(lambda: relay.sent == 1, "the relay removed what it sent")
                before = looks.looks
                group = unique_name("g")
                for n in range(20):  # commits of another connection that add no outbox row
                    await other.dedup.mark(group, f"id-{n}")
                    await other.checkpoints.set(unique_name("cp"), n + 1)
                await other.outbox.add(_message(topic, 2))  # the positive control
                assert await _received(sub, 1) == [2]
                await _until(lambda: relay.sent == 2, "the relay removed what it sent")
                assert looks.looks - before == 1
            await sub.close()
        finally:
            await broker.close()
