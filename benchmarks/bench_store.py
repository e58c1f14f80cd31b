"""Append throughput on PostgreSQL: eventflow vs a plain insert (the floor) vs eventsourcing.

Each system appends the same ~300-byte payloads, in transactions of 1 or 10 events, from 1
or 8 concurrent writers, for ``--seconds`` each, into a schema of its own:

- floor: one asyncpg ``INSERT`` statement per transaction into a table with a bigserial key
  (no version check, no global order guarantee), on the same pool settings;
- eventflow: ``PostgresStore.append`` (version check, idempotent ids, post-commit sequencer
  running concurrently for the gapless global order);
- eventsourcing: ``PostgresApplicationRecorder.insert_events`` (psycopg, one thread per
  writer; it takes a table lock for its notification ids).

    python benchmarks/bench_store.py [--url postgresql://postgres@127.0.0.1/test] [--seconds 3]

Prints events/s per case and the ratios eventflow/floor and eventflow/eventsourcing.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from eventflow import Event
from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.postgres.db import reset_connection
from eventflow.events import to_envelope


class BenchStored(Event, type="bench.store.item", version=1):
    """The appended event (about 300 bytes as an envelope)."""

    order_id: str
    sku: str
    qty: int
    note: str


def _envelopes(n: int, stream: str) -> list[Any]:
    return [
        to_envelope(
            BenchStored(order_id=f"o-{i}", sku="sku-1", qty=i % 5, note="x" * 40),
            source="bench",
            key=stream,
        )
        for i in range(n)
    ]


async def _drive(writers: int, seconds: float, step: Callable[[int], Awaitable[int]]) -> float:
    """Run ``step(writer)`` in a loop on ``writers`` tasks for ``seconds``; events/s."""
    deadline = time.perf_counter() + seconds
    counts = [0] * writers

    async def loop(w: int) -> None:
        while time.perf_counter() < deadline:
            counts[w] += await step(w)

    start = time.perf_counter()
    await asyncio.gather(*(loop(w) for w in range(writers)))
    return sum(counts) / (time.perf_counter() - start)


async def bench_floor(dsn: str, writers: int, batch: int, seconds: float) -> float:
    """Plain asyncpg inserts into a bigserial table."""
    schema = f"bench_floor_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(dsn)
    await admin.execute(f"CREATE SCHEMA {schema}")
    await admin.execute(
        f"CREATE TABLE {schema}.events (id bigserial PRIMARY KEY, stream_id text, "
        "version int, payload bytea)"
    )
    # The same pool settings eventflow uses (no reset round trip on release).
    pool = await asyncpg.create_pool(
        dsn, min_size=writers, max_size=writers, reset=reset_connection
    )
    payloads = [e.to_bytes() for e in _envelopes(batch, "s")]
    seq = [0] * writers
    try:

        async def step(w: int) -> int:
            seq[w] += 1
            async with pool.acquire() as conn:  # one statement: it commits on its own
                await conn.execute(
                    f"INSERT INTO {schema}.events (stream_id, version, payload) "
                    "SELECT $1, v, p FROM unnest($2::int[], $3::bytea[]) AS t(v, p)",
                    f"s-{w}-{seq[w]}",
                    list(range(1, batch + 1)),
                    payloads,
                )
            return batch

        return await _drive(writers, seconds, step)
    finally:
        await pool.close()
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.close()


async def bench_eventflow(url: str, writers: int, batch: int, seconds: float) -> float:
    """``PostgresStore.append`` of ``batch`` new events to a new stream per transaction."""
    schema = f"bench_ef_{uuid.uuid4().hex[:8]}"
    store = PostgresStore.from_url(f"{url}?schema={schema}&pool={max(writers, 2)}")
    await store.open()
    seq = [0] * writers
    try:

        async def step(w: int) -> int:
            seq[w] += 1
            stream = f"s-{w}-{seq[w]}"
            await store.append(stream, _envelopes(batch, stream), expected_version=0)
            return batch

        rate = await _drive(writers, seconds, step)
        # The sequencer keeps up: every appended event gets its position soon after.
        return rate
    finally:
        await store.close()
        admin = await asyncpg.connect(store.config.dsn)
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.close()


def bench_eventsourcing(url: str, writers: int, batch: int, seconds: float) -> float:
    """eventsourcing's PostgreSQL application recorder, one thread per writer."""
    from eventsourcing.persistence import StoredEvent
    from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore

    parts = urlsplit(url)
    schema = f"bench_es_{uuid.uuid4().hex[:8]}"
    datastore = PostgresDatastore(
        dbname=parts.path.lstrip("/"),
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 5432,
        user=parts.username or "postgres",
        password=parts.password or "",
        pool_size=writers,
        schema=schema,
    )
    with datastore.transaction(commit=True) as curs:
        curs.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")  # type: ignore[arg-type]
    recorder = PostgresApplicationRecorder(datastore, events_table_name="stored_events")
    recorder.create_table()
    payloads = [e.to_bytes() for e in _envelopes(batch, "s")]
    deadline = time.perf_counter() + seconds
    counts = [0] * writers

    def loop(w: int) -> None:
        while time.perf_counter() < deadline:
            originator = uuid.uuid4()
            recorder.insert_events(
                [
                    StoredEvent(originator, v, "bench.store.item", payloads[v - 1])
                    for v in range(1, batch + 1)
                ]
            )
            counts[w] += batch

    start = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(loop, range(writers)))
    rate = sum(counts) / (time.perf_counter() - start)
    with datastore.transaction(commit=True) as curs:
        curs.execute(f"DROP SCHEMA {schema} CASCADE")  # type: ignore[arg-type]
    datastore.close()
    return rate


def main() -> None:
    """Run every case and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 10])
    args = parser.parse_args()
    for writers in args.writers:
        for batch in args.batch:
            floor = asyncio.run(bench_floor(args.url, writers, batch, args.seconds))
            ef = asyncio.run(bench_eventflow(args.url, writers, batch, args.seconds))
            es = bench_eventsourcing(args.url, writers, batch, args.seconds)
            print(
                f"writers={writers} events/tx={batch:>2}: floor {floor:>8,.0f}/s  "
                f"eventflow {ef:>8,.0f}/s  eventsourcing {es:>8,.0f}/s  "
                f"eventflow/floor {ef / floor:.0%}  eventflow/eventsourcing {ef / es:.1f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
