"""Reading the PostgreSQL store's global order: positions are stored as runs of consecutive
event ids (``ef_runs``), and reads turn them back into one position per event.

These tests pin what a run-based read must keep: 64-bit positions, pages that read about a
page of events however long a run is (with or without table statistics), and reads right
after an append that see all of it, however many sequencer passes that takes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest

from eventflow import Event
from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.postgres import events as pg_events
from eventflow.adapters.postgres import sequencer as pg_sequencer
from eventflow.events import to_envelope
from eventflow.stores import store_for
from eventflow.testing.broker_contract import eventually
from eventflow.testing.postgres import isolated_schema, postgres_url

pytestmark = pytest.mark.service("postgres")


class ReadItem(Event, type="it.reads.item"):
    """An appended event."""

    n: int


async def _connect(store: PostgresStore) -> Any:
    cfg = store.config
    return await asyncpg.connect(cfg.dsn, server_settings={"search_path": cfg.schema})


async def test_positions_past_the_32_bit_range_read_back(postgres_store: PostgresStore) -> None:
    start = 2**31 - 4  # the next positions cross 2,147,483,647
    conn = await _connect(postgres_store)
    try:
        await conn.execute("UPDATE ef_sequence SET last = $1", start)
    finally:
        await conn.close()
    await postgres_store.append("big", [ReadItem(n=n) for n in range(6)])
    every = [rec.position for rec in [rec async for rec in postgres_store.read_all()]]
    assert every == [start + n for n in range(1, 7)]
    page = [rec.position async for rec in postgres_store.read_all(after=2**31 - 1, limit=2)]
    assert page == [2**31, 2**31 + 1]
    assert [rec.position async for rec in postgres_store.read_stream("big", from_version=5)] == [
        start + 5,
        start + 6,
    ]


def _rows_read(plan: dict[str, Any], table: str) -> int:
    """Rows the plan's scans of ``table`` returned, over all their loops."""
    rows = 0
    if plan.get("Relation Name") == table:
        rows += plan["Actual Rows"] * plan["Actual Loops"]
    for child in plan.get("Plans", []):
        rows += _rows_read(child, table)
    return rows


@pytest.mark.parametrize("analyzed", [False, True], ids=["no-statistics", "analyzed"])
async def test_a_page_of_a_long_run_reads_about_a_page(
    postgres_store: PostgresStore, analyzed: bool
) -> None:
    """One append of 3,000 events is one run; a 100-event page from its middle reads about
    100 events, not the rest of the run (right after a bulk append the planner has no
    statistics, and a plan that scanned the run's whole remaining id range made replay
    quadratic)."""
    await postgres_store.append(
        "bulk", [to_envelope(ReadItem(n=n), source="t") for n in range(3000)]
    )
    assert await postgres_store.last_position() == 3000
    conn = await _connect(postgres_store)
    try:
        if analyzed:
            await conn.execute("ANALYZE ef_events; ANALYZE ef_runs")
        await conn.execute(f"PREPARE ef_page (bigint, bigint) AS {pg_events._READ_ALL}")
        for after in (0, 1500, 2950):
            raw = await conn.fetchval(
                f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE ef_page({after}, 100)"
            )
            plan = json.loads(raw)[0]["Plan"]
            rows = await conn.fetch(f"EXECUTE ef_page({after}, 100)")
            assert [r[0] for r in rows] == list(range(after + 1, min(after + 100, 3000) + 1))
            assert _rows_read(plan, "ef_events") <= 100, json.dumps(plan, indent=1)
    finally:
        await conn.close()


async def test_a_read_right_after_a_large_append_sees_all_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sequencer pass numbers at most a batch of ids; the passes a read runs first keep
    going until everything committed is numbered, so ``read_stream`` never reports an event
    at position 0 (the store's own sequencer is held back here, so the reads' passes do all
    the work)."""
    monkeypatch.setattr(pg_sequencer, "_SEQUENCE_BATCH", 10)
    monkeypatch.setattr(pg_sequencer, "_COALESCE", 30.0)
    async with isolated_schema(postgres_url()) as url:
        s = store_for(url)
        assert isinstance(s, PostgresStore)
        await s.open()
        try:
            await s.append("many", [ReadItem(n=n) for n in range(25)])
            await s.append("one", [ReadItem(n=25)])
            assert [rec.position async for rec in s.read_stream("one")] == [26]
            assert await s.last_position() == 26
            assert [rec.position async for rec in s.read_all(after=20)] == [21, 22, 23, 24, 25, 26]
        finally:
            await s.close()


async def test_the_listener_connection_is_reconnected_after_it_is_lost(
    postgres_store: PostgresStore,
) -> None:
    """The connection that hears the store's notifications (new positions, lease releases)
    is killed (a failover, an idle timeout): it is connected again and listens again, so a
    subscriber is woken by the next append's notification, not by its slow re-read."""
    store = postgres_store
    old = store._sequencer.listener
    assert old is not None
    admin = await asyncpg.connect(postgres_url())
    try:
        await admin.execute("SELECT pg_terminate_backend($1)", old.get_server_pid())
    finally:
        await admin.close()

    def reconnected() -> bool:
        new = store._sequencer.listener
        return new is not None and new is not old and not new.is_closed()

    await eventually(reconnected, timeout=10, message="a new listener connection")
    woken = asyncio.get_running_loop().create_future()
    tick = store._sequencer.tick
    assert tick is not None
    tick.add_done_callback(lambda _: woken.done() or woken.set_result(None))
    await store.append("listener-s", [ReadItem(n=1)])
    await store._sync()  # number it now: the sequencer pass notifies ef_sequenced
    await asyncio.wait_for(woken, 5)  # the notification came through the new connection
