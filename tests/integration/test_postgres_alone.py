"""A transaction whose one write is an append declared its last (``append_riding(...,
last=True)``, a saga handling that guessed its saga): sent alone, without BEGIN and
COMMIT (``adapters/postgres/alone.py``), atomic on its own; anything that ran before sends
the BEGIN and the append goes inside the transaction as usual."""

from __future__ import annotations

import asyncio

import pytest
from pg_statements import statements

from eventflow import ConcurrencyError, Event, StoreError
from eventflow.adapters.postgres import PostgresStore
from eventflow.envelope import Envelope
from eventflow.errors import AlreadyHandled
from eventflow.events import envelope_for

pytestmark = pytest.mark.service("postgres")


class Alone(Event, type="it.alone.item"):
    """One append's event."""

    n: int


def _command(n: int) -> tuple[str, Envelope]:
    return "it.alone.command", envelope_for(Alone(n=n), source="test")


def _ours(seen: list[str]) -> list[str]:
    # (asyncpg's own look-ups of a type, once per connection, are not the store's)
    return [q for q in seen if "ef_" in q or q.startswith(("BEGIN", "COMMIT", "ROLLBACK"))]


async def _outbox(store: PostgresStore) -> list[str]:
    return [m.message_id for m in await store.outbox.pending()]


async def test_the_last_write_alone_is_the_transaction(postgres_store: PostgresStore) -> None:
    """Events, commands and the dedup entry in one statement, no BEGIN, no COMMIT; the
    settlement's mark sends nothing, and any statement after it raises."""
    sends = [_command(1)]
    async with postgres_store.transaction() as tx:
        with statements(postgres_store) as seen:
            version = await postgres_store.append_riding(
                "s-1",
                [Alone(n=1)],
                [postgres_store.outbox.rider(sends), postgres_store.handled_rider("g", "m-1")],
                expected_version=0,
                last=True,
            )
            await postgres_store.mark_handled("g", "m-1", tx)
        await asyncio.sleep(0)  # asyncpg calls its query loggers soon after, not at once
        assert version == 1
        (statement,) = _ours(seen)
        assert statement.startswith("WITH ins AS (INSERT INTO ef_events")
        assert "ON CONFLICT" not in statement.split("ok AS")[0]  # a conflict fails it whole
        with pytest.raises(StoreError, match="committed by its one statement"):
            await tx.execute("SELECT 1")
    assert await postgres_store.stream_version("s-1") == 1
    assert await _outbox(postgres_store) == [sends[0][1].id]
    assert await postgres_store.dedup.seen("g", "m-1")


async def test_a_transaction_that_ran_nothing_sends_no_begin(
    postgres_store: PostgresStore,
) -> None:
    async with postgres_store.transaction():
        with statements(postgres_store) as seen:
            pass
    assert _ours(seen) == []


async def test_after_a_read_the_last_write_goes_inside_the_transaction(
    postgres_store: PostgresStore,
) -> None:
    """A statement ran first (a read: the saga was loaded): BEGIN went with it, and the
    append is the usual one, inside, committed by the COMMIT."""
    await postgres_store.append("s-2", [Alone(n=0)], expected_version=0)
    async with postgres_store.transaction():
        with statements(postgres_store) as seen:
            version = await postgres_store.stream_version("s-2")
            await postgres_store.append_riding(
                "s-2", [Alone(n=1)], [], expected_version=version, last=True
            )
    ours = _ours(seen)
    assert ours[0] == "BEGIN;", ours
    assert "ON CONFLICT DO NOTHING" in ours[-1]  # the append inside the transaction
    assert await postgres_store.stream_version("s-2") == 2


async def test_a_conflict_alone_writes_nothing_and_the_transaction_goes_on(
    postgres_store: PostgresStore,
) -> None:
    """The stream moved (a wrong guess): the alone statement wrote nothing, the slow path
    inside the transaction finds the conflict; the retry at the right version commits
    with the transaction."""
    await postgres_store.append("s-3", [Alone(n=0)], expected_version=0)
    sends = [_command(1)]
    async with postgres_store.transaction():
        with pytest.raises(ConcurrencyError):
            await postgres_store.append_riding(
                "s-3",
                [Alone(n=1)],
                [postgres_store.outbox.rider(sends)],
                expected_version=0,
                last=True,
            )
        assert await _outbox(postgres_store) == []
        await postgres_store.append_riding(
            "s-3", [Alone(n=1)], [postgres_store.outbox.rider(sends)], expected_version=1, last=True
        )
    assert await postgres_store.stream_version("s-3") == 2
    assert await _outbox(postgres_store) == [sends[0][1].id]


async def test_a_version_guard_alone_inserts_nothing(postgres_store: PostgresStore) -> None:
    """At a version the stream has not reached: the alone statement inserts no row, the
    slow path tells the conflict, nothing is left."""
    sends = [_command(1)]
    with pytest.raises(ConcurrencyError):
        async with postgres_store.transaction():
            await postgres_store.append_riding(
                "s-4",
                [Alone(n=1)],
                [postgres_store.outbox.rider(sends)],
                expected_version=3,
                last=True,
            )
    assert await postgres_store.stream_version("s-4") == 0
    assert await _outbox(postgres_store) == []


async def test_a_copy_handled_first_fails_the_alone_statement_whole(
    postgres_store: PostgresStore,
) -> None:
    await postgres_store.dedup.mark("g", "m-5")
    sends = [_command(1)]
    with pytest.raises(AlreadyHandled):
        async with postgres_store.transaction():
            await postgres_store.append_riding(
                "s-5",
                [Alone(n=1)],
                [postgres_store.outbox.rider(sends), postgres_store.handled_rider("g", "m-5")],
                expected_version=0,
                last=True,
            )
    assert await postgres_store.stream_version("s-5") == 0
    assert await _outbox(postgres_store) == []
