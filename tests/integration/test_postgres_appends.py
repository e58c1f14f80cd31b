"""Appends to the PostgreSQL store under concurrency, inside callers' transactions.

An append with ``expected_version=None`` (any version) never raises ``ConcurrencyError``:
outside a transaction the store retries it, and inside ``postgres_store.transaction()`` too (the
first try skips conflicting rows, a savepoint keeps the retries usable, and a retry sees the
other append).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from eventflow import ConcurrencyError, Event
from eventflow.adapters.postgres import PostgresStore
from eventflow.events import envelope_for

pytestmark = pytest.mark.service("postgres")

TASKS = 8
APPENDS = 25


class Appended(Event, type="it.appends.item"):
    """One append's event."""

    task: int
    n: int


async def test_appends_at_any_version_in_transactions_never_conflict(
    postgres_store: PostgresStore,
) -> None:
    async def task(t: int) -> list[int]:
        versions = []
        for n in range(APPENDS):
            async with postgres_store.transaction():
                versions.append(await postgres_store.append("shared", [Appended(task=t, n=n)]))
        return versions

    results = await asyncio.gather(*(task(t) for t in range(TASKS)))
    every = sorted(v for versions in results for v in versions)
    assert every == list(range(1, TASKS * APPENDS + 1))
    stored = [rec.event async for rec in postgres_store.read_stream("shared")]
    assert len(stored) == TASKS * APPENDS
    for t in range(TASKS):  # each task's events in its own order
        assert [e.n for e in stored if isinstance(e, Appended) and e.task == t] == list(
            range(APPENDS)
        )


async def test_a_batch_that_goes_in_only_in_part_inside_a_transaction_leaves_nothing(
    postgres_store: PostgresStore,
) -> None:
    """Inside a transaction the first try skips conflicting rows instead of failing (no
    savepoint): a batch that went in only in part is taken out again before the slow path
    decides, and the transaction goes on."""
    await postgres_store.append("partial", [Appended(task=0, n=0)], expected_version=0)
    stored = envelope_for(Appended(task=0, n=1), source="test")
    await postgres_store.append("partial-ids", [stored], expected_version=0)
    fresh = envelope_for(Appended(task=2, n=0), source="test")
    async with postgres_store.transaction():
        # Version 1 is taken, version 2 is free: only the second row could go in.
        with pytest.raises(ConcurrencyError) as conflict:
            await postgres_store.append(
                "partial", [Appended(task=1, n=0), Appended(task=1, n=1)], expected_version=0
            )
        assert (conflict.value.expected, conflict.value.actual) == (0, 1)
        # An id already stored beside a new one: the stored one is skipped, the new one
        # goes in at the next version.
        assert await postgres_store.append("partial-ids", [stored, fresh], expected_version=1) == 2
        assert await postgres_store.append("partial", [Appended(task=3, n=0)]) == 2
    events = [rec.event async for rec in postgres_store.read_stream("partial")]
    assert [e.task for e in events if isinstance(e, Appended)] == [0, 3]
    records = [rec async for rec in postgres_store.read_stream("partial-ids")]
    assert [(r.envelope.id, r.stream_version) for r in records] == [(stored.id, 1), (fresh.id, 2)]


@pytest.fixture
async def lost_races(
    postgres_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """The store's appends in a transaction lose their first try and then 150 races in the
    slow path (its statement raises a unique violation), then go in; yields how many
    statements the slow path sent."""
    from eventflow.adapters.postgres import events

    async with postgres_store.db.connection() as conn:
        await conn.execute("CREATE SEQUENCE fx_races")
        await conn.execute(
            "CREATE FUNCTION fx_losing_append(s text, e bigint, i text[], b bytea[], c text[]) "
            "RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN "
            "IF nextval('fx_races') <= 150 THEN "
            "RAISE unique_violation USING MESSAGE = 'fx: another append took the version'; "
            "END IF; RETURN ef_append_v4(s, e, i, b, c); END $$"
        )
    monkeypatch.setattr(events, "_SLOW_APPEND", "SELECT fx_losing_append($1, $2, $3, $4, $5)")

    async def first_try_loses(*_: object) -> None:
        return None  # the fast path's first try skipped its rows: a concurrent append

    monkeypatch.setattr(postgres_store, "_fast_append_in_tx", first_try_loses)

    async def statements() -> int:
        async with postgres_store.db.connection() as conn:
            return int(await conn.fetchval("SELECT last_value FROM fx_races"))

    yield statements


async def test_an_append_at_any_version_in_a_transaction_outlasts_any_run_of_lost_races(
    postgres_store: PostgresStore, lost_races: Callable[[], Awaitable[int]]
) -> None:
    """Each race an append at any version loses inside a READ COMMITTED transaction is
    another append committed first, so its retries make progress however many it takes
    (under load one task of eight lost more than 100 in a row and was refused with a
    ``ConcurrencyError``)."""
    async with postgres_store.transaction():
        assert await postgres_store.append("raced", [Appended(task=0, n=0)]) == 1
    assert await lost_races() == 151


async def test_an_append_at_any_version_in_a_repeatable_read_transaction_does_not_retry(
    postgres_store: PostgresStore, lost_races: Callable[[], Awaitable[int]]
) -> None:
    """In a REPEATABLE READ transaction the snapshot never moves, so a retry would lose the
    same race again: the lost race is a ``ConcurrencyError`` at once."""
    with pytest.raises(ConcurrencyError):
        async with postgres_store.transaction():
            async with postgres_store.db.connection() as conn:
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            await postgres_store.append("raced", [Appended(task=0, n=0)])
    assert await lost_races() == 1
