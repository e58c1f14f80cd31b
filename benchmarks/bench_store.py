"""Append throughput on PostgreSQL: eventflow vs a plain insert (the floor) vs eventsourcing.

Each system appends the same ~300-byte envelopes (built before the clock starts), in
transactions of 1 or 10 events, from 1 or 8 concurrent writers, ``--events`` in all per
case, each into a schema of its own:

- floor: one asyncpg ``INSERT`` statement per transaction into a table with a bigserial key
  (no version check, no global order guarantee), on the same pool settings;
- eventflow: ``PostgresStore.append`` (version check, idempotent ids, post-commit sequencer
  running concurrently for the gapless global order);
- eventsourcing: ``PostgresApplicationRecorder.insert_events`` (psycopg, one thread per
  writer; it takes a table lock for its notification ids).

    python benchmarks/bench_store.py [--url postgresql://postgres@127.0.0.1/test] [--events N]
        [--rounds N] [--cpu]

Prints events/s per case and the ratios eventflow/floor and eventflow/eventsourcing. With
``--rounds``, floor and eventflow alternate that many times per case and the median ratio is
printed. With ``--cpu`` (Linux, server on this machine), each timed loop also reports the
CPU it cost: this process plus the server processes of its connections, per 10 events, and
how much of it was this process's. On a shared machine the CPU ratio is steadier than the
throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import statistics
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


def _cpu_seconds(backends: set[int]) -> tuple[float, dict[int, float]]:
    """CPU time so far of this process, and of each server process in ``backends`` (the
    benchmarked system's connections: other sessions of a shared server are left out)."""
    server = {}
    for pid in backends:
        try:
            with open(f"/proc/{pid}/stat") as f:
                raw = f.read()
        except OSError:
            continue  # the process ended
        fields = raw.rsplit(")", 1)[1].split()
        server[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime, server


async def _backends(admin: Any, app: str) -> set[int]:
    """The server pids of the connections named ``app`` (``application_name``)."""
    rows = await admin.fetch("SELECT pid FROM pg_stat_activity WHERE application_name = $1", app)
    return {r[0] for r in rows}


class _CpuMeter:
    """With ``--cpu``: the CPU seconds per event of the last timed loop, in all and of this
    process alone (the rest is the server's)."""

    enabled = False
    per_event = 0.0
    own_per_event = 0.0


_cpu = _CpuMeter()


async def _drive(
    writers: int,
    steps: int,
    step: Callable[[int, int], Awaitable[int]],
    backends: Callable[[], Awaitable[set[int]]],
) -> float:
    """Run ``steps`` transactions per writer on ``writers`` tasks; return events/s. With
    ``--cpu``, the CPU of this process and of the ``backends()`` is measured around it."""
    total = 0

    async def loop(w: int) -> None:
        nonlocal total
        for i in range(steps):
            done = await step(w, i)  # not `total += await ...`: that reads total first
            total += done

    # The prepared payloads are scaffolding, not work of the store: keep the collector's full
    # passes from walking them during the timed loop (the same for every system).
    gc.collect()
    gc.freeze()
    own, server = _cpu_seconds(await backends()) if _cpu.enabled else (0.0, {})
    try:
        start = time.perf_counter()
        await asyncio.gather(*(loop(w) for w in range(writers)))
        return total / (time.perf_counter() - start)
    finally:
        if _cpu.enabled:
            # A connection opened during the loop counts from 0 (its start-up included).
            own_after, server_after = _cpu_seconds(await backends())
            spent = sum(t - server.get(pid, 0.0) for pid, t in server_after.items())
            _cpu.own_per_event = (own_after - own) / max(total, 1)
            _cpu.per_event = _cpu.own_per_event + spent / max(total, 1)
        gc.unfreeze()


def _payloads(writers: int, steps: int, batch: int) -> list[list[list[Any]]]:
    """Every writer's batches of envelopes, built before the clock starts (all systems
    write the same bytes; building them is the caller's work, not the store's)."""
    return [[_envelopes(batch, f"s-{w}-{i}") for i in range(steps)] for w in range(writers)]


async def bench_floor(dsn: str, writers: int, batch: int, steps: int) -> float:
    """Plain asyncpg inserts into a bigserial table, one statement per transaction."""
    schema = f"bench_floor_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(dsn)
    await admin.execute(f"CREATE SCHEMA {schema}")
    await admin.execute(
        f"CREATE TABLE {schema}.events (id bigserial PRIMARY KEY, stream_id text, "
        "version int, payload bytea)"
    )
    # The same pool settings eventflow uses (no reset round trip on release).
    pool = await asyncpg.create_pool(
        dsn,
        min_size=writers,
        max_size=writers,
        reset=reset_connection,
        server_settings={"application_name": schema},
    )
    data = [[[e.to_bytes() for e in b] for b in per] for per in _payloads(writers, steps, batch)]
    versions = list(range(1, batch + 1))
    try:

        async def step(w: int, i: int) -> int:
            async with pool.acquire() as conn:  # one statement: it commits on its own
                await conn.execute(
                    f"INSERT INTO {schema}.events (stream_id, version, payload) "
                    "SELECT $1, v, p FROM unnest($2::int[], $3::bytea[]) AS t(v, p)",
                    f"s-{w}-{i}",
                    versions,
                    data[w][i],
                )
            return batch

        return await _drive(writers, steps, step, lambda: _backends(admin, schema))
    finally:
        await pool.close()
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.close()


async def bench_eventflow(url: str, writers: int, batch: int, steps: int) -> float:
    """``PostgresStore.append`` of ``batch`` new envelopes to a new stream per transaction."""
    schema = f"bench_ef_{uuid.uuid4().hex[:8]}"
    store = PostgresStore.from_url(
        f"{url}?schema={schema}&pool={max(writers, 2)}&application_name={schema}"
    )
    await store.open()
    admin = await asyncpg.connect(store.config.dsn)
    data = _payloads(writers, steps, batch)
    try:

        async def step(w: int, i: int) -> int:
            await store.append(f"s-{w}-{i}", data[w][i], expected_version=0)
            return batch

        return await _drive(writers, steps, step, lambda: _backends(admin, schema))
    finally:
        await store.close()
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.close()


def bench_eventsourcing(url: str, writers: int, batch: int, steps: int) -> float:
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
    data = [
        [
            [
                StoredEvent(uuid.uuid4(), v, "bench.store.item", e.to_bytes())
                for v, e in enumerate(b, start=1)
            ]
            for b in per
        ]
        for per in _payloads(writers, steps, batch)
    ]

    def loop(w: int) -> None:
        for stored in data[w]:
            recorder.insert_events(stored)

    gc.collect()
    gc.freeze()
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(loop, range(writers)))
        rate = writers * steps * batch / (time.perf_counter() - start)
    finally:
        gc.unfreeze()
    with datastore.transaction(commit=True) as curs:
        curs.execute(f"DROP SCHEMA {schema} CASCADE")  # type: ignore[arg-type]
    datastore.close()
    return rate


def _cpu_text() -> str:
    if not _cpu.enabled:
        return ""
    own, server = _cpu.own_per_event, _cpu.per_event - _cpu.own_per_event
    return (
        f" ({_cpu.per_event * 1e7:.0f} µs CPU/10 events:"
        f" {own * 1e7:.0f} here + {server * 1e7:.0f} server)"
    )


def main() -> None:
    """Run every case and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument(
        "--events", type=int, default=40_000, help="events per system and case (over writers)"
    )
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 10])
    parser.add_argument(
        "--rounds", type=int, default=1, help="floor/eventflow rounds per case (median ratio)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="also report CPU per event (Linux, local server)"
    )
    args = parser.parse_args()
    _cpu.enabled = args.cpu
    for writers in args.writers:
        for batch in args.batch:
            steps = max(1, args.events // (writers * batch))
            ratios, cpu_ratios = [], []
            for n in range(args.rounds):
                floor = asyncio.run(bench_floor(args.url, writers, batch, steps))
                floor_cpu, floor_text = _cpu.per_event, _cpu_text()
                ef = asyncio.run(bench_eventflow(args.url, writers, batch, steps))
                ratios.append(ef / floor)
                line = (
                    f"writers={writers} events/tx={batch:>2}: floor {floor:>8,.0f}/s{floor_text}"
                    f"  eventflow {ef:>8,.0f}/s{_cpu_text()}  eventflow/floor {ef / floor:.0%}"
                )
                if args.cpu:
                    cpu_ratios.append(floor_cpu / _cpu.per_event)
                    line += f" (CPU {cpu_ratios[-1]:.0%})"
                if n == args.rounds - 1:  # eventsourcing once per case: it is slow
                    es = bench_eventsourcing(args.url, writers, batch, steps)
                    line += f"  eventsourcing {es:>8,.0f}/s  eventflow/eventsourcing {ef / es:.1f}x"
                print(line, flush=True)
            if args.rounds > 1:
                summary = f"  median eventflow/floor {statistics.median(ratios):.0%}"
                if cpu_ratios:
                    summary += f", by CPU {statistics.median(cpu_ratios):.0%}"
                print(summary, flush=True)


if __name__ == "__main__":
    main()
