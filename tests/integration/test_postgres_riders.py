"""Writes that ride on a PostgreSQL append (``adapters/postgres/rider.py``): in the
append's own statement when every event goes in, in one of their own after an append the
slow path sorted out, never after a conflict."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pg_statements import statements

from eventflow import ConcurrencyError, Event
from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.postgres.rider import Rider, alone, riding
from eventflow.envelope import Envelope
from eventflow.errors import AlreadyHandled
from eventflow.events import envelope_for
from eventflow.sagas.tables import IndexRow, NewTimer, Writes, tables_for

pytestmark = pytest.mark.service("postgres")


class Appended(Event, type="it.riders.item"):
    """One append's event."""

    n: int


def _command(n: int) -> tuple[str, Envelope]:
    return "it.riders.command", envelope_for(Appended(n=n), source="test")


async def _outbox(store: PostgresStore) -> list[str]:
    return [m.message_id for m in await store.outbox.pending()]


def test_riders_are_numbered_after_the_append_and_guarded() -> None:
    first = Rider("DELETE FROM a WHERE x = $1 AND {appended}", (1,))
    second = Rider("INSERT INTO b SELECT $1, $2 WHERE {appended}", (2, 3))
    sql = riding("INSERT INTO e SELECT $1, $2 RETURNING 1", 2, [first, second])
    assert "r0 AS (DELETE FROM a WHERE x = $3 AND (SELECT ok FROM ok))" in sql
    assert "r1 AS (INSERT INTO b SELECT $4, $5 WHERE (SELECT ok FROM ok))" in sql
    assert alone([first, second]) == (
        "WITH r0 AS (DELETE FROM a WHERE x = $1 AND true), "
        "r1 AS (INSERT INTO b SELECT $2, $3 WHERE true) SELECT 1"
    )
    with pytest.raises(ValueError, match="appended"):
        alone([Rider("DELETE FROM a", ())])


async def test_a_saga_transition_is_one_statement(postgres_store: PostgresStore) -> None:
    tables = tables_for(postgres_store)
    await tables.setup()
    at = datetime.fromtimestamp(1.0, UTC)
    writes = Writes(
        IndexRow("saga-o-1", "o", "1", "running", at, at), [NewTimer("step:", 30.0, "1:s")], ()
    )
    sends = [_command(1)]
    async with postgres_store.transaction() as tx:
        with statements(postgres_store) as seen:
            version = await tables.append(
                tx, "saga-o-1", [Appended(n=1), Appended(n=2)], 0, writes, sends
            )
    assert version == 2
    # (asyncpg's own look-ups of a type, once per connection, are not the store's)
    (statement,) = [q for q in seen if "ef_" in q]
    assert all(t in statement for t in ("ef_events", "ef_sagas", "ef_saga_timers", "ef_outbox"))
    assert await _outbox(postgres_store) == [sends[0][1].id]
    found = await tables.find("saga-o-1")
    assert found is not None and found.status == "running"


async def test_a_batch_that_went_in_only_in_part_rides_nothing(
    postgres_store: PostgresStore,
) -> None:
    await postgres_store.append("partial", [Appended(n=0)], expected_version=0)
    sends = [_command(1)]
    async with postgres_store.transaction():
        # Version 1 is taken, version 2 is free: only the second row went in, and was
        # taken out again; the slow path finds the conflict.
        with pytest.raises(ConcurrencyError):
            await postgres_store.append_riding(
                "partial",
                [Appended(n=1), Appended(n=2)],
                [postgres_store.outbox.rider(sends)],
                expected_version=0,
            )
    assert await _outbox(postgres_store) == []
    assert await postgres_store.stream_version("partial") == 1


async def test_riders_follow_an_append_the_slow_path_sorted_out(
    postgres_store: PostgresStore,
) -> None:
    """An id already stored beside a new one (a re-run that got further this time): the
    slow path appends the new one, and the riders go in a statement of their own."""
    stored = envelope_for(Appended(n=1), source="test")
    await postgres_store.append("ids", [stored], expected_version=0)
    sends = [_command(2)]
    async with postgres_store.transaction():
        with statements(postgres_store) as seen:
            version = await postgres_store.append_riding(
                "ids",
                [stored, envelope_for(Appended(n=2), source="test")],
                [postgres_store.outbox.rider(sends)],
                expected_version=1,
            )
    assert version == 2
    assert seen[-1].startswith("WITH r0 AS (INSERT INTO ef_outbox")
    assert await _outbox(postgres_store) == [sends[0][1].id]


async def test_riding_outside_a_transaction_opens_one(postgres_store: PostgresStore) -> None:
    sends = [_command(1)]
    rider = postgres_store.outbox.rider(sends)
    assert await postgres_store.append_riding("alone", [Appended(n=1)], [rider]) == 1
    assert await _outbox(postgres_store) == [sends[0][1].id]
    with pytest.raises(ConcurrencyError):
        await postgres_store.append_riding(
            "alone",
            [Appended(n=2)],
            [postgres_store.outbox.rider([_command(2)])],
            expected_version=0,
        )
    assert await _outbox(postgres_store) == [sends[0][1].id]


def _saga_writes(handled: tuple[str, str]) -> Writes:
    at = datetime.fromtimestamp(1.0, UTC)
    row = IndexRow("saga-o-9", "o", "9", "running", at, at)
    return Writes(row, [NewTimer("step:", 30.0, "1:s")], (), handled=handled)


async def test_the_dedup_entry_rides_on_the_append_and_is_not_marked_again(
    postgres_store: PostgresStore,
) -> None:
    """``Writes.handled``: the input's dedup entry goes in with the append's statement, and
    the settlement's ``mark_handled`` of it in that transaction sends nothing more."""
    tables = tables_for(postgres_store)
    await tables.setup()
    async with postgres_store.transaction() as tx:
        with statements(postgres_store) as seen:
            await tables.append(
                tx, "saga-o-9", [Appended(n=1)], 0, _saga_writes(("g", "m-1")), [_command(1)]
            )
            await postgres_store.mark_handled("g", "m-1", tx)
            # Another entry, or the same one cancelled by a compensation, is written.
            await postgres_store.mark_handled("g", "m-2", tx)
    (riding_sql, marked) = [q for q in seen if "ef_" in q]
    assert all(t in riding_sql for t in ("ef_events", "ef_sagas", "ef_outbox", "ef_dedup"))
    assert "m-2" not in riding_sql and marked.startswith("INSERT INTO ef_dedup")
    assert await postgres_store.dedup.seen_many("g", ["m-1", "m-2"]) == {"m-1", "m-2"}
    # A transaction of its own knows nothing of the first one's rider.
    with pytest.raises(AlreadyHandled):
        async with postgres_store.transaction() as tx:
            await postgres_store.mark_handled("g", "m-1", tx)


async def test_a_copy_handled_first_rolls_the_append_and_its_riders_back(
    postgres_store: PostgresStore,
) -> None:
    """The input's dedup entry committed first (a copy handled): the append's statement
    fails whole with ``AlreadyHandled``; no event, index row, timer or command is left."""
    tables = tables_for(postgres_store)
    await tables.setup()
    await postgres_store.dedup.mark("g", "m-1")
    with pytest.raises(AlreadyHandled):
        async with postgres_store.transaction() as tx:
            await tables.append(
                tx, "saga-o-9", [Appended(n=1)], 0, _saga_writes(("g", "m-1")), [_command(1)]
            )
    assert await postgres_store.stream_version("saga-o-9") == 0
    assert await tables.find("saga-o-9") is None
    assert (await tables.earliest("o", 10))[0] == []
    assert await _outbox(postgres_store) == []


async def test_a_copy_handled_first_fails_the_riders_after_the_slow_path(
    postgres_store: PostgresStore,
) -> None:
    """The same when the append took the slow path (an id stored already) and the riders
    went in a statement of their own: ``AlreadyHandled``, nothing new left."""
    stored = envelope_for(Appended(n=1), source="test")
    await postgres_store.append("ids", [stored], expected_version=0)
    await postgres_store.dedup.mark("g", "m-1")
    rider = postgres_store.handled_rider("g", "m-1")
    with pytest.raises(AlreadyHandled):
        async with postgres_store.transaction():
            await postgres_store.append_riding(
                "ids",
                [stored, envelope_for(Appended(n=2), source="test")],
                [postgres_store.outbox.rider([_command(2)]), rider],
                expected_version=1,
            )
    assert await postgres_store.stream_version("ids") == 1
    assert await _outbox(postgres_store) == []
