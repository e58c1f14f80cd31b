"""The relays under leases (SQLite and PostgreSQL): a relay that lost its lease stops with
``LeaseLostError`` (its retry loop does not swallow it), and one that does not know it lost
it (a paused process) cannot delete outbox messages or move the event relay's checkpoint
after another relay took over."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from eventflow import Envelope, Event
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.postgres.db import PostgresConfig
from eventflow.adapters.sqlite.store import SqliteStore
from eventflow.errors import LeaseLostError
from eventflow.ports import Store
from eventflow.runtime.relay import (
    EVENT_RELAY_CHECKPOINT,
    OUTBOX_RELAY_LEASE,
    EventRelay,
    OutboxRelay,
)
from eventflow.testing.lease_faults import unaware_of_loss
from eventflow.testing.postgres import isolated_schema, postgres_url

TTL = 1.5


class Relayed(Event, type="it.relay.relayed"):
    """Something to relay."""

    n: int


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.service("postgres"))])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[list[Store]]:
    """Two opened stores on one new database, with leases of TTL seconds."""
    async with contextlib.AsyncExitStack() as stack:
        made: list[Store] = []
        for _ in range(2):
            store: Store
            if request.param == "sqlite":
                store = SqliteStore(str(tmp_path / "relay.db"), busy_timeout=0.5, lease_ttl=TTL)
            else:
                if not made:
                    url = await stack.enter_async_context(isolated_schema(postgres_url()))
                config = dataclasses.replace(PostgresConfig.from_url(url), lease_ttl=TTL)
                store = PostgresStore(config)
            await store.open()
            stack.push_async_callback(store.close)
            made.append(store)
        yield made


def _messages(start: int, count: int) -> list[tuple[str, Envelope]]:
    return [
        ("it.relay.out", Envelope.create(Relayed.event_type, {"n": i}))
        for i in range(start, start + count)
    ]


async def _eventually(condition: object, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not await condition():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def test_an_unaware_outbox_relay_deletes_nothing_after_a_takeover(
    stores: list[Store], hub: MemoryBroker
) -> None:
    first, second = stores
    stale = unaware_of_loss(first)
    relay = OutboxRelay(stale.store, hub)
    task = asyncio.create_task(relay.run())
    try:
        await first.outbox.add(_messages(0, 3))
        await _eventually(lambda: _pending_is(first, 0))
        stale.stall()  # it believes it still holds the outbox lease
        async with asyncio.timeout(TTL + 10), second.leases.hold(OUTBOX_RELAY_LEASE):
            later = _messages(3, 2)
            await first.outbox.add(later)
            # the stale relay sends them (at least once: consumers dedup) but its removal
            # is refused, and its run() ends instead of retrying
            with pytest.raises(LeaseLostError, match="another holder took it over"):
                await asyncio.wait_for(task, 10)
            assert relay.sent == 3
            pending = await second.outbox.pending()
            assert [m.message_id for m in pending] == [env.id for _, env in later]
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def _pending_is(store: Store, count: int) -> bool:
    return len(await store.outbox.pending()) == count


async def test_an_unaware_event_relay_cannot_move_the_checkpoint_after_a_takeover(
    stores: list[Store], hub: MemoryBroker
) -> None:
    first, second = stores
    stale = unaware_of_loss(first)
    relay = EventRelay(stale.store, hub, checkpoint_every=1)
    task = asyncio.create_task(relay.run())
    try:
        await first.append("relay-1", [Relayed(n=1), Relayed(n=2)])
        await _eventually(lambda: _checkpoint_is(first, 2))
        stale.stall()
        async with asyncio.timeout(TTL + 10), second.leases.hold(EVENT_RELAY_CHECKPOINT) as lease:
            await second.checkpoints.set(EVENT_RELAY_CHECKPOINT, 2, lease=lease)
            await first.append("relay-1", [Relayed(n=3)])
            with pytest.raises(LeaseLostError, match="another holder took it over"):
                await asyncio.wait_for(task, 10)
            assert relay.sent == 3  # it sent the third event, and could not record it
            assert await second.checkpoints.get(EVENT_RELAY_CHECKPOINT) == 2
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def _checkpoint_is(store: Store, position: int) -> bool:
    return await store.checkpoints.get(EVENT_RELAY_CHECKPOINT) == position


@contextlib.asynccontextmanager
async def _renewals_blocked(store: Store, name: str) -> AsyncIterator[None]:
    """Another connection locks the file (SQLite) or the lease's row (PostgreSQL)."""
    if isinstance(store, SqliteStore):
        conn = sqlite3.connect(store.path, isolation_level=None, check_same_thread=False)
        try:
            await asyncio.to_thread(conn.execute, "BEGIN EXCLUSIVE")
            yield
            await asyncio.to_thread(conn.execute, "ROLLBACK")
        finally:
            conn.close()
        return
    assert isinstance(store, PostgresStore)
    pg = await asyncpg.connect(
        store.config.dsn, server_settings={"search_path": store.config.schema}
    )
    try:
        async with pg.transaction():
            await pg.execute("SELECT 1 FROM ef_leases WHERE name = $1 FOR UPDATE", name)
            yield
    finally:
        await pg.close()


async def test_a_relay_whose_renewals_are_blocked_stops_with_lease_lost(
    stores: list[Store], hub: MemoryBroker
) -> None:
    first, _ = stores
    relay = OutboxRelay(first, hub)
    task = asyncio.create_task(relay.run())
    try:
        await first.outbox.add(_messages(0, 2))
        await _eventually(lambda: _pending_is(first, 0))
        async with _renewals_blocked(first, OUTBOX_RELAY_LEASE):
            with pytest.raises(LeaseLostError, match="not renewed"):
                await asyncio.wait_for(task, TTL * 3)
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
