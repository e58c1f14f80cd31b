"""The PostgreSQL store's global order never skips an event committed late.

Workload: 8 writers append one event per transaction until 2,400 committed (sized by count,
not time, so a loaded machine runs the same workload; at most 60 s), sleeping a random time
between the insert and the commit, and rolling back 10% of their transactions, while a
subscriber reads from the start. The subscriber must receive every committed event exactly
once, no rolled-back one, each stream in version order. The negative control reads the
same table the naive way (``id > last`` on the insertion bigserial, polled every 1 ms) and
must miss some events on the same workload — showing the test can see the failure.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from eventflow import Event
from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.postgres import events as pg_events
from eventflow.errors import ConcurrencyError
from eventflow.events import to_envelope
from eventflow.ports import RecordedEvent
from eventflow.stores import store_for
from eventflow.testing.postgres import postgres_url, with_schema

WRITERS = 8
COMMITS = 2400
MAX_DURATION = 60.0
STREAMS = 40
ROLLBACK_RATE = 0.10
MAX_COMMIT_DELAY = 0.004


class GaplessTick(Event, type="it.gapless.tick"):
    """One event per writer transaction."""

    writer: int
    n: int


class _Rollback(Exception):
    pass


async def _writer(
    postgres_store: PostgresStore,
    writer: int,
    deadline: float,
    committed: set[str],
    rolled: set[str],
) -> None:
    rng = random.Random(writer)
    n = 0
    while len(committed) < COMMITS and time.monotonic() < deadline:
        n += 1
        event_id = ""
        try:
            async with postgres_store.transaction():
                env = to_envelope(GaplessTick(writer=writer, n=n), source="w", key="k")
                event_id = env.id
                await postgres_store.append(f"gapless-{rng.randrange(STREAMS)}", [env])
                await asyncio.sleep(rng.random() * MAX_COMMIT_DELAY)
                if rng.random() < ROLLBACK_RATE:
                    raise _Rollback
        except (_Rollback, ConcurrencyError):
            rolled.add(event_id)
        else:
            committed.add(event_id)


async def _naive_reader(dsn: str, schema: str, stop: asyncio.Event) -> set[str]:
    """The broken way: remember the highest bigserial id seen, poll ``id > last``."""
    conn = await asyncpg.connect(dsn, server_settings={"search_path": schema})
    seen: set[str] = set()
    last = 0
    try:
        while not stop.is_set():
            rows = await conn.fetch(
                "SELECT id, event_id FROM ef_events WHERE id > $1 ORDER BY id", last
            )
            for row in rows:
                seen.add(row[1])
                last = row[0]
            await asyncio.sleep(0.001)
    finally:
        await conn.close()
    return seen


async def test_subscriber_never_skips_late_commits(
    postgres_store: PostgresStore, waiter: Callable[..., Awaitable[None]]
) -> None:
    received: list[RecordedEvent] = []
    committed: set[str] = set()
    rolled: set[str] = set()

    async def follow() -> None:
        async for rec in postgres_store.subscribe(after=0):
            received.append(rec)

    stop_naive = asyncio.Event()
    cfg = postgres_store.config
    naive = asyncio.create_task(_naive_reader(cfg.dsn, cfg.schema, stop_naive))
    follower = asyncio.create_task(follow())
    deadline = time.monotonic() + MAX_DURATION
    await asyncio.gather(
        *(_writer(postgres_store, w, deadline, committed, rolled) for w in range(WRITERS))
    )
    # Then one more event, after every writer ended: the subscriber delivers in position
    # order, so once it has this one, anything extra before it has been delivered too.
    marker = to_envelope(GaplessTick(writer=WRITERS, n=0), source="w", key="k")
    await postgres_store.append("gapless-marker", [marker])
    committed.add(marker.id)
    await waiter(
        lambda: any(r.envelope.id == marker.id for r in received),
        timeout=30,
        what="the subscriber to reach the last event",
    )
    follower.cancel()
    stop_naive.set()
    naive_seen = await naive
    await asyncio.gather(follower, return_exceptions=True)

    ids = [r.envelope.id for r in received]
    assert len(committed) > 2000, "the workload was too small to mean anything"
    assert rolled, "the workload must roll some transactions back"
    assert len(ids) == len(set(ids)), "an event was delivered twice"
    assert set(ids) == committed, (
        f"missing {len(committed - set(ids))}, unexpected {len(set(ids) - committed)}"
    )
    assert not set(ids) & rolled
    assert [r.position for r in received] == list(range(1, len(received) + 1))
    last_version: dict[str, int] = {}
    for rec in received:
        assert rec.stream_version == last_version.get(rec.stream_id, 0) + 1, rec
        last_version[rec.stream_id] = rec.stream_version

    # Negative control: the naive reader, on the same workload, skipped late commits.
    skipped = committed - naive_seen
    assert skipped, "the naive `id > last` reader skipped nothing; the workload shows nothing"


async def test_open_unrelated_transaction_does_not_delay_live_delivery(
    postgres_store: PostgresStore,
) -> None:
    cfg = postgres_store.config
    blocker = await asyncpg.connect(cfg.dsn, server_settings={"search_path": cfg.schema})
    got: dict[str, float] = {}

    async def follow() -> None:
        async for rec in postgres_store.subscribe(after=await postgres_store.last_position()):
            got[rec.envelope.id] = time.monotonic()

    follower = asyncio.create_task(follow())
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("SELECT txid_current()")  # holds an xid: an open writer
        sent: dict[str, float] = {}
        for n in range(10):
            env = to_envelope(GaplessTick(writer=99, n=n), source="t", key="k")
            await postgres_store.append("open-tx", [env])
            sent[env.id] = time.monotonic()
            await asyncio.sleep(0.5)  # 10 appends over 5 s with the transaction open
        deadline = time.monotonic() + 5
        while len(got) < len(sent) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await tx.rollback()
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await blocker.close()
    delays = [got[i] - t for i, t in sent.items() if i in got]
    assert len(delays) == len(sent), "some events never arrived while the transaction was open"
    assert max(delays) < 1.0, f"live delivery delayed up to {max(delays):.2f}s"


async def test_a_writer_newer_than_every_finished_transaction_is_not_skipped(
    postgres_store: PostgresStore,
) -> None:
    """A pass that reads past the id of a still-running writer keeps that id and numbers it
    once the writer commits, even when the writer is the newest transaction of all (its id
    is then at or above the pass snapshot's xmax, so that xmax cannot serve as its horizon)."""
    cfg = postgres_store.config
    other = await asyncpg.connect(cfg.dsn, server_settings={"search_path": cfg.schema})
    numbered = (
        "SELECT e.event_id FROM ef_runs r JOIN ef_events e ON e.id >= r.id "
        "AND e.id < r.id + r.n ORDER BY r.position, e.id"
    )
    first = to_envelope(GaplessTick(writer=1, n=1), source="t", key="a")
    late = to_envelope(GaplessTick(writer=2, n=1), source="t", key="b")
    try:
        await postgres_store.append("before", [first])
        assert await postgres_store.last_position() == 1
        await asyncio.sleep(0.1)  # the store's own sequencer has nothing left to finish
        async with postgres_store.transaction():
            await postgres_store.append("late", [late])
            # A pass on another connection while the writer runs: it sees the id drawn but
            # not the row, and no transaction has finished since the writer took its id.
            await other.fetchval("SELECT ef_sequence_v3(10000)")
            assert [r[0] for r in await other.fetch(numbered)] == [first.id]
        records = [rec async for rec in postgres_store.read_all()]
    finally:
        await other.close()
    assert [rec.envelope.id for rec in records] == [first.id, late.id]
    assert [rec.position for rec in records] == [1, 2]


async def test_old_gaps_keep_each_stream_in_version_order(postgres_store: PostgresStore) -> None:
    """Ids missed for over a second, or beyond the newest thousand, wait in ef_gaps; when
    their writer commits, they are numbered in the same pass as its younger ids, in id order,
    and at once (another store reads, as another process would)."""
    cfg = postgres_store.config
    other = store_for(with_schema(postgres_url(), cfg.schema))
    assert isinstance(other, PostgresStore)
    await other.open()
    first = to_envelope(GaplessTick(writer=3, n=0), source="t", key="c")
    many = [to_envelope(GaplessTick(writer=3, n=n), source="t", key="c") for n in range(1, 1501)]
    try:
        async with postgres_store.transaction():
            await postgres_store.append("slow", [first])
            await asyncio.sleep(1.5)  # passes keep missing its id: it moves to ef_gaps
            await postgres_store.append("slow", many)  # more ids in flight than stay young
            await other.last_position()  # a pass that misses them all
        # At once: before this store's own sequencer (woken by the commit) runs a pass.
        records = [rec async for rec in other.read_all()]
    finally:
        await other.close()
    assert [rec.envelope.id for rec in records] == [e.id for e in [first, *many]]
    assert [rec.stream_version for rec in records] == list(range(1, 1502))
    assert [rec.position for rec in records] == list(range(1, 1502))


async def test_rolled_back_ids_under_an_open_transaction_leave_passes_short(
    postgres_store: PostgresStore,
) -> None:
    """While an old transaction holds xmin back, rolled-back ids cannot be dropped; after a
    second they wait in ef_gaps instead of being looked up on every pass."""
    cfg = postgres_store.config
    blocker = await asyncpg.connect(cfg.dsn, server_settings={"search_path": cfg.schema})
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("SELECT pg_current_xact_id()")  # an open writer
        for n in range(200):
            with pytest.raises(_Rollback):
                async with postgres_store.transaction():
                    await postgres_store.append(
                        f"rb-{n}", [to_envelope(GaplessTick(writer=4, n=n), source="t")]
                    )
                    raise _Rollback
        await asyncio.sleep(1.5)  # the store's sequencer polls and ages the gaps
        kept = await blocker.fetchrow(
            "SELECT cardinality(gaps) AS young, (SELECT count(*) FROM ef_gaps) AS old "
            "FROM ef_sequence"
        )
        env = to_envelope(GaplessTick(writer=4, n=999), source="t")
        await postgres_store.append("after", [env])
        assert [rec.envelope.id async for rec in postgres_store.read_all()] == [env.id]
        await tx.rollback()
    finally:
        await blocker.close()
    assert kept["young"] == 0
    assert kept["old"] == 200


@pytest.mark.parametrize("name", ["_APPEND_ANY", "_APPEND_NEW", "_APPEND_AT"])
async def test_appends_take_a_transaction_id_before_drawing_event_ids(
    postgres_store: PostgresStore, name: str
) -> None:
    """The sequencer's horizon rule needs every writer's transaction id to exist before its
    first event id: the fast-path INSERT checks `pg_current_xact_id()` in a one-time filter
    on the very plan node that draws the ids, so no row (and no id) comes before it."""
    cfg = postgres_store.config
    sql = getattr(pg_events, name)
    at_version = "$5" in sql
    types = "text, text[], bytea[], text[]" + (", bigint" if at_version else "")
    args = "'s', '{a}', '{\\\\x00}', '{c}'" + (", 1" if at_version else "")
    conn = await asyncpg.connect(cfg.dsn, server_settings={"search_path": cfg.schema})
    try:
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        await conn.execute(f"PREPARE ef_probe ({types}) AS {sql}")
        plan = [row[0] for row in await conn.fetch(f"EXPLAIN VERBOSE EXECUTE ef_probe({args})")]
    finally:
        await conn.close()
    node = next(i for i, line in enumerate(plan) if "Output: nextval(" in line)
    assert "One-Time Filter: (" in plan[node + 1], "\n".join(plan)
    assert "pg_current_xact_id() IS NOT NULL" in plan[node + 1], "\n".join(plan)
