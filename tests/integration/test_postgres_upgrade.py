"""Opening a PostgreSQL schema that an earlier version or a person changed.

Earlier versions queued every appended event's id in ``ef_unsequenced`` for the sequencer.
The first open by this version numbers whatever the old queue still holds, starts scanning
after the newest event and replaces the queue by a view that earlier versions cannot append
through; nothing is lost and positions stay gapless. Later ones wrote one ``ef_positions`` row
per event: the first open turns those rows into runs (``ef_runs``) and leaves a view that
makes such a version fail loudly.
"""

from __future__ import annotations

import asyncpg
import pytest

from eventflow import Event
from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.postgres import events as pg_events
from eventflow.errors import StoreError
from eventflow.events import to_envelope
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema, postgres_url

pytestmark = pytest.mark.service("postgres")

# The tables of the earlier schema that the upgrade touches, as those versions made them.
_OLD_SCHEMA = """
CREATE TABLE ef_events (
    id bigserial PRIMARY KEY,
    event_id text NOT NULL UNIQUE,
    stream_id text NOT NULL,
    stream_version bigint NOT NULL,
    type text NOT NULL,
    envelope bytea NOT NULL,
    UNIQUE (stream_id, stream_version)
);
CREATE TABLE ef_unsequenced (id bigint PRIMARY KEY);
CREATE TABLE ef_positions (position bigint PRIMARY KEY, id bigint NOT NULL UNIQUE);
CREATE TABLE ef_sequence (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    last bigint NOT NULL
);
"""


class Upgraded(Event, type="it.upgrade.item"):
    """An event appended before and after the upgrade."""

    n: int


def _store(url: str) -> PostgresStore:
    store = store_for(url)
    assert isinstance(store, PostgresStore)
    return store


async def _current_schema(url: str) -> PostgresStore:
    """A store whose schema this version made (opened once and closed)."""
    store = _store(url)
    await store.open()
    await store.close()
    return store


async def _connect(store: PostgresStore) -> asyncpg.Connection:
    """A plain connection to the store's schema, to change it as an earlier version or a
    person would."""
    cfg = store.config
    return await asyncpg.connect(cfg.dsn, server_settings={"search_path": cfg.schema})


async def test_first_open_numbers_the_old_queue_and_drops_it() -> None:
    old = [to_envelope(Upgraded(n=n), source="t", key="s") for n in range(1, 5)]
    async with isolated_schema(postgres_url()) as url:
        store = _store(url)
        conn = await _connect(store)
        try:
            await conn.execute(_OLD_SCHEMA)
            for version, env in enumerate(old, start=1):
                await conn.execute(
                    "INSERT INTO ef_events (event_id, stream_id, stream_version, type, envelope)"
                    " VALUES ($1, 's', $2, $3, $4)",
                    env.id,
                    version,
                    env.type,
                    env.to_bytes(),
                )
            # The old sequencer had numbered the first two; the other two were still queued.
            await conn.execute("INSERT INTO ef_positions VALUES (1, 1), (2, 2)")
            await conn.execute("INSERT INTO ef_sequence VALUES (true, 2)")
            await conn.execute("INSERT INTO ef_unsequenced VALUES (3), (4)")

            await store.open()
            try:
                new = to_envelope(Upgraded(n=5), source="t", key="s")
                assert await store.append("s", [new], expected_version=4) == 5
                records = [rec async for rec in store.read_all()]
            finally:
                await store.close()
            # An earlier version started now: its setup skips the existing name, and its
            # appends fail instead of writing events that only its own sequencer numbers.
            await conn.execute("CREATE TABLE IF NOT EXISTS ef_unsequenced (id bigint PRIMARY KEY)")
            with pytest.raises(asyncpg.PostgresError, match="ef_unsequenced"):
                await conn.execute("INSERT INTO ef_unsequenced (id) VALUES (6)")
        finally:
            await conn.close()
    assert [rec.envelope.id for rec in records] == [e.id for e in [*old, new]]
    assert [rec.position for rec in records] == [1, 2, 3, 4, 5]


# The sequencer tables of the version that wrote one position row per event.
_ROW_PER_POSITION_SCHEMA = """
CREATE TABLE ef_events (
    id bigserial PRIMARY KEY,
    event_id text COLLATE "C" NOT NULL UNIQUE,
    stream_id text COLLATE "C" NOT NULL,
    stream_version bigint NOT NULL,
    type text NOT NULL,
    envelope bytea NOT NULL,
    UNIQUE (stream_id, stream_version)
);
CREATE TABLE ef_positions (position bigint PRIMARY KEY, id bigint NOT NULL UNIQUE);
CREATE TABLE ef_sequence (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    last bigint NOT NULL,
    scanned bigint NOT NULL DEFAULT 0,
    gaps bigint[] NOT NULL DEFAULT '{}',
    horizons xid8[] NOT NULL DEFAULT '{}',
    missed timestamptz[] NOT NULL DEFAULT '{}',
    watch xid8[] NOT NULL DEFAULT '{}'
);
"""


async def test_first_open_turns_position_rows_into_runs() -> None:
    """Ids 1 2 4 3 5 6 at positions 1..6 (id 3 committed late): runs (1,1,2), (3,4,1),
    (4,3,1), (5,5,2); every position reads back the same, and the old table is a trap."""
    envs = [to_envelope(Upgraded(n=n), source="t", key=f"s{n}") for n in range(1, 7)]
    async with isolated_schema(postgres_url()) as url:
        store = _store(url)
        conn = await _connect(store)
        try:
            await conn.execute(_ROW_PER_POSITION_SCHEMA)
            for env in envs:
                await conn.execute(
                    "INSERT INTO ef_events (event_id, stream_id, stream_version, type, envelope)"
                    " VALUES ($1, $2, 1, $3, $4)",
                    env.id,
                    env.key,
                    env.type,
                    env.to_bytes(),
                )
            await conn.execute(
                "INSERT INTO ef_positions VALUES (1, 1), (2, 2), (3, 4), (4, 3), (5, 5), (6, 6)"
            )
            await conn.execute("INSERT INTO ef_sequence (last, scanned) VALUES (6, 6)")

            await store.open()
            try:
                runs = await conn.fetch("SELECT position, id, n FROM ef_runs ORDER BY position")
                after = to_envelope(Upgraded(n=7), source="t", key="s7")
                await store.append("s7", [after])
                records = [rec async for rec in store.read_all()]
                middle = [rec async for rec in store.read_all(after=3, limit=2)]
                inside = [rec async for rec in store.read_all(after=5, limit=1)]
                third = [rec async for rec in store.read_stream("s3")]
            finally:
                await store.close()
            # An earlier version started now: its setup skips the existing name; its reads
            # and sequencer passes fail, saying why.
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS ef_positions (position bigint PRIMARY KEY, id bigint)"
            )
            with pytest.raises(asyncpg.PostgresError, match="earlier eventflow version"):
                await conn.fetch("SELECT position FROM ef_positions WHERE position > 0")
            with pytest.raises(asyncpg.PostgresError, match="earlier eventflow version"):
                await conn.execute("INSERT INTO ef_positions (position, id) VALUES (8, 8)")
            # A process of that version started before the upgrade calls its sequencer.
            with pytest.raises(asyncpg.PostgresError, match="earlier eventflow version"):
                await conn.fetchval("SELECT ef_sequence_v2(10000)")
        finally:
            await conn.close()
    assert [tuple(r) for r in runs] == [(1, 1, 2), (3, 4, 1), (4, 3, 1), (5, 5, 2)]
    order = [envs[i - 1] for i in (1, 2, 4, 3, 5, 6)] + [after]
    assert [rec.envelope.id for rec in records] == [e.id for e in order]
    assert [rec.position for rec in records] == [1, 2, 3, 4, 5, 6, 7]
    assert [(rec.position, rec.envelope.id) for rec in middle] == [
        (4, envs[2].id),
        (5, envs[4].id),
    ]
    assert [(rec.position, rec.envelope.id) for rec in inside] == [(6, envs[5].id)]
    assert [rec.position for rec in third] == [4]


async def test_an_id_sequence_with_a_cache_is_refused() -> None:
    """With a per-backend cache, ids could be drawn below the sequencer's `top`: refuse."""
    async with isolated_schema(postgres_url()) as url:
        conn = await _connect(await _current_schema(url))
        try:
            await conn.execute("ALTER SEQUENCE ef_events_id_seq CACHE 20")
            again = store_for(url)
            with pytest.raises(StoreError, match="ALTER SEQUENCE ef_events_id_seq CACHE 1"):
                await again.open()
        finally:
            await conn.close()


async def test_the_type_column_upgrade_waits_briefly_then_says_what_blocks_it() -> None:
    """Making the old `type` column nullable locks ef_events once; behind a transaction that
    holds the table, the open gives up after 2 s (appends would queue behind the lock) and
    says what to do; once that transaction ends, the open upgrades the column."""
    async with isolated_schema(postgres_url()) as url:
        store = _store(url)
        conn = await _connect(store)
        blocker = await _connect(store)
        try:
            await conn.execute(_ROW_PER_POSITION_SCHEMA)
            await conn.execute("INSERT INTO ef_sequence (last) VALUES (0)")
            tx = blocker.transaction()
            await tx.start()
            await blocker.fetchval("SELECT count(*) FROM ef_events")  # a long report, say
            with pytest.raises(StoreError, match="another transaction holds the table"):
                await store.open()
            await tx.rollback()
            await store.open()
            try:
                await store.append("s", [Upgraded(n=1)])
                assert [rec.position async for rec in store.read_all()] == [1]
            finally:
                await store.close()
            nullable = await conn.fetchval(
                "SELECT NOT attnotnull FROM pg_attribute "
                "WHERE attrelid = 'ef_events'::regclass AND attname = 'type'"
            )
            assert nullable
        finally:
            await blocker.close()
            await conn.close()


async def test_an_open_restores_the_trap_trigger_of_an_upgraded_schema() -> None:
    """A schema upgraded before the trap had its insert trigger gets it on the next open."""
    async with isolated_schema(postgres_url()) as url:
        conn = await _connect(await _current_schema(url))
        try:
            await conn.execute("DROP TRIGGER ef_positions_moved ON ef_positions")
            again = store_for(url)
            await again.open()
            await again.close()
            with pytest.raises(asyncpg.PostgresError, match="earlier eventflow version"):
                await conn.execute("INSERT INTO ef_positions (position, id) VALUES (1, 1)")
        finally:
            await conn.close()


async def test_a_dedup_table_of_an_earlier_version_gets_its_cancellation_column() -> None:
    """``ef_dedup`` made before compensations could cancel commands has no ``cancelled_by``:
    the open adds it, keeping the entries (plain handled ones), and cancellations work."""
    async with isolated_schema(postgres_url()) as url:
        store = _store(url)
        conn = await _connect(store)
        try:
            await conn.execute(
                'CREATE TABLE ef_dedup (grp text COLLATE "C" NOT NULL, message_id text '
                'COLLATE "C" NOT NULL, handled_at timestamptz NOT NULL DEFAULT now(), '
                "PRIMARY KEY (grp, message_id))"
            )
            await conn.execute("INSERT INTO ef_dedup (grp, message_id) VALUES ('g', 'old')")
            await store.open()
            try:
                assert await store.dedup.seen("g", "old")
                assert await store.dedup.cancelled_by("g", "old") is None
                assert await store.dedup.mark_new("g", "new", cancelled_by="undo")
                assert await store.dedup.cancelled_by("g", "new") == "undo"
            finally:
                await store.close()
        finally:
            await conn.close()


async def test_correlations_stored_before_the_column_are_still_traced() -> None:
    """A schema of the version before (no correlation_id column, a full index over the id in
    each envelope): the first open adds the column and swaps the full index for partial
    ones; events stored before, and those a process of that version appends meanwhile (with
    its ef_append_v3, or a plain insert), are found by `correlated` with the new ones, in
    order, through the indexes."""
    async with isolated_schema(postgres_url()) as url:
        store = await _current_schema(url)
        conn = await _connect(store)
        old_insert = (
            "INSERT INTO ef_events (event_id, stream_id, stream_version, envelope) "
            "VALUES ($1, $2, $3, $4)"
        )
        first, second, third, other = (
            to_envelope(Upgraded(n=n), source="old", correlation_id="corr-1" if n < 4 else "x")
            for n in range(1, 5)
        )
        try:
            await conn.execute(
                "DROP INDEX ef_events_correlation_id, ef_events_correlation_stored; "
                "ALTER TABLE ef_events DROP COLUMN correlation_id; "
                "CREATE INDEX ef_events_correlation ON ef_events (ef_correlation_v1(envelope))"
            )
            await conn.execute(old_insert, first.id, "s", 1, first.to_bytes())
            await conn.execute(old_insert, other.id, "t", 1, other.to_bytes())
            await store.open()
            try:
                # A process of the version before, still running: its slow-path append.
                await conn.fetchval(
                    "SELECT ef_append_v3('s', 1, $1, $2)", [second.id], [second.to_bytes()]
                )
                await store.append("s", [third], expected_version=2)
                found = await store.correlated("corr-1")
                assert [r.envelope.id for r in found] == [first.id, second.id, third.id]
                assert [r.position for r in found] == [1, 3, 4]
                assert [r.envelope.id for r in await store.correlated("x")] == [other.id]
                columns = await conn.fetchval(
                    "SELECT array_agg(correlation_id ORDER BY id) FROM ef_events"
                )
                assert columns == [None, None, None, "corr-1"]
                indexes = {
                    r[0]
                    for r in await conn.fetch(
                        "SELECT indexname FROM pg_indexes WHERE tablename = 'ef_events' "
                        "AND schemaname = current_schema()"
                    )
                }
                assert "ef_events_correlation" not in indexes
                assert {"ef_events_correlation_id", "ef_events_correlation_stored"} <= indexes
                # The lookup's condition, alone (on a table this small the planner would
                # rather walk the primary key for the ORDER BY ... LIMIT).
                where = pg_events._CORRELATED.split("FROM ef_events e WHERE ")[1]
                where = where.split(" ORDER BY e.id")[0]
                await conn.execute("SET enable_seqscan = off")
                plan = "\n".join(
                    r[0]
                    for r in await conn.fetch(
                        "EXPLAIN SELECT count(*) FROM ef_events e WHERE "
                        + where.replace("$1", "'corr-1'")
                    )
                )
                assert "ef_events_correlation_id" in plan, plan
                assert "ef_events_correlation_stored" in plan, plan
            finally:
                await store.close()
        finally:
            await conn.close()
