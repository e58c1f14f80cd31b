"""How long ``eventflow trace CORRELATION_ID`` takes on a large PostgreSQL store.

Fills a throwaway schema with N events (default 1,000,000; COPY in chunks, 5 events per
correlation over 1,000 streams, as a busy shop's log would hold), lets the sequencer number
them, then times what ``trace`` does for a few correlation ids picked at random: the lookup
through the ``ef_events_correlation_id`` index (with ``--old-rows``, rows stored without the
correlation_id column, as an earlier version did: through ``ef_events_correlation_stored``,
the partial index over the id in the envelope) plus the dead-letter and outbox reads
(``eventflow.cli.trace.collect``) and drawing the tree; then runs the command itself,
``eventflow trace CORRELATION_ID --store URL``, as a new process (``--cli`` times, what a
person waits for: the interpreter's start, the imports, opening the store, the lookup, the
output), beside ``eventflow --version`` (the start and imports alone). With ``--scan`` it
also times the way trace worked before the index (a ``read_all`` over the whole log,
filtered in Python), once. The schema is dropped at the end.

    python benchmarks/bench_trace.py [--events 1000000] [--postgres-url URL] [--lookups 20]
        [--cli 5] [--scan] [--old-rows]
    python benchmarks/bench_trace.py --append-cost [--rounds 6]

Prints the figures; it asserts nothing about time (the target is under 1 s per trace).
``--append-cost`` instead measures what the index costs appends: rounds of 2,000 events
(single-event appends) on SQLite and PostgreSQL, alternating with and without it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import orjson

from eventflow.cli.trace import collect, render
from eventflow.envelope import Envelope
from eventflow.stores import store_for

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1/test"
PER_CORRELATION = 5
STREAMS = 1000
CHUNK = 50_000


def _rows(
    n: int, start: int, template: dict[str, Any], old: bool
) -> list[tuple[str, str, int, bytes, str | None]]:
    """Events ``start`` .. ``start + n - 1``: ids and correlation ids derived from the
    number, so the picked correlations can be named again; with ``old``, without the
    correlation_id column (as rows an earlier version stored)."""
    rows = []
    for i in range(start, start + n):
        doc = dict(template)
        doc["id"] = f"ev-{i:09d}"
        doc["correlation_id"] = f"corr-{i // PER_CORRELATION:09d}"
        doc["causation_id"] = f"ev-{i - 1:09d}" if i % PER_CORRELATION else None
        doc["data"] = {"n": i}
        stream = i % STREAMS
        corr = None if old else doc["correlation_id"]
        rows.append((doc["id"], f"bench-{stream}", i // STREAMS + 1, orjson.dumps(doc), corr))
    return rows


async def _fill(url: str, n: int, old: bool) -> None:
    import asyncpg  # the postgres extra

    from eventflow.testing.postgres import _admin_dsn

    template = orjson.loads(Envelope.create("bench.trace.happened", {"n": 0}).to_bytes())
    schema = url.rsplit("schema=", 1)[1]
    conn = await asyncpg.connect(_admin_dsn(url), server_settings={"search_path": schema})
    try:
        for start in range(0, n, CHUNK):
            rows = _rows(min(CHUNK, n - start), start, template, old)
            await conn.copy_records_to_table(
                "ef_events",
                records=rows,
                columns=["event_id", "stream_id", "stream_version", "envelope", "correlation_id"],
            )
        await conn.execute("ANALYZE ef_events")
    finally:
        await conn.close()


async def _drop(url: str) -> None:
    import asyncpg

    from eventflow.testing.postgres import _admin_dsn

    conn = await asyncpg.connect(_admin_dsn(url))
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{url.rsplit("schema=", 1)[1]}" CASCADE')
    finally:
        await conn.close()


async def main(args: argparse.Namespace) -> None:
    """Fill, number, time the lookups (and the scan), drop."""
    from eventflow.testing.postgres import with_schema

    url = with_schema(args.postgres_url, f"bench_trace_{uuid.uuid4().hex[:8]}")
    store = store_for(url)
    await store.open()  # creates the tables and the index
    try:
        began = time.perf_counter()
        await _fill(url, args.events, args.old_rows)
        filled = time.perf_counter() - began
        began = time.perf_counter()
        async for _ in store.read_all(limit=1):  # sequencing: every event gets its position
            break
        numbered = time.perf_counter() - began
        last = await store.last_position()
        form = " (stored as by an earlier version)" if args.old_rows else ""
        print(
            f"filled {args.events:,} events{form} in {filled:.1f} s (COPY), numbered in "
            f"{numbered:.1f} s; last position {last:,}"
        )
        correlations = args.events // PER_CORRELATION
        times: list[float] = []
        rng = random.Random(7)
        for _ in range(args.lookups):
            corr = f"corr-{rng.randrange(correlations):09d}"
            began = time.perf_counter()
            nodes = await collect(store, corr)
            text = render(corr, nodes)
            times.append(time.perf_counter() - began)
            assert len(nodes) == PER_CORRELATION, (corr, len(nodes))
        print(
            f"trace (index): {args.lookups} correlations of {PER_CORRELATION} events each: "
            f"median {statistics.median(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms"
        )
        print("one of them:\n" + text)
        if args.cli:
            _time_cli(url, [f"corr-{rng.randrange(correlations):09d}" for _ in range(args.cli)])
        if args.scan:
            corr = f"corr-{rng.randrange(correlations):09d}"
            began = time.perf_counter()
            found = [r async for r in store.read_all() if r.envelope.correlation_id == corr]
            took = time.perf_counter() - began
            assert len(found) == PER_CORRELATION
            print(f"trace (whole-log scan, as before the index): {took:.1f} s")
    finally:
        await store.close()
        await _drop(url)


def _time_cli(url: str, correlations: list[str]) -> None:
    """Run ``eventflow trace`` as a new process for each correlation; print the wall and
    CPU times (the CPU time is the steadier figure on a machine other jobs load).

    The children may write bytecode (to a temporary ``PYTHONPYCACHEPREFIX`` when the
    environment forbids it, as CI images do) and a first run of each command is not timed:
    an installed package has its bytecode, so compiling the sources is no part of what a
    person waits for."""
    import resource
    import tempfile

    cli_url = f"{url}&pool=2"  # a command line needs few connections (the server is shared)
    env = dict(os.environ)
    cache = None
    if env.pop("PYTHONDONTWRITEBYTECODE", None):
        cache = tempfile.TemporaryDirectory()
        env["PYTHONPYCACHEPREFIX"] = cache.name

    def run(argv: list[str]) -> tuple[float, float, subprocess.CompletedProcess[str]]:
        cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "eventflow.cli", *argv], capture_output=True, text=True, env=env
        )
        wall = time.perf_counter() - began
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = after.ru_utime - cpu.ru_utime + after.ru_stime - cpu.ru_stime
        assert done.returncode == 0, (argv, done.returncode, done.stderr)
        return wall, used, done

    try:
        run(["--version"])
        run(["trace", correlations[0], "--store", cli_url])  # warm-up: bytecode, caches
        start = [run(["--version"])[:2] for _ in range(3)]
        times = []
        for corr in correlations:
            wall, used, done = run(["trace", corr, "--store", cli_url])
            times.append((wall, used))
            assert corr in done.stdout, done.stdout
            assert done.stdout.count("bench.trace.happened") == PER_CORRELATION, done.stdout
    finally:
        if cache is not None:
            cache.cleanup()

    def median(pairs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(p[i] for p in pairs)

    print(
        f"eventflow trace CORRELATION_ID --store postgresql://... as a new process, "
        f"{len(times)} correlations: wall median {median(times, 0):.3f} s (max "
        f"{max(t[0] for t in times):.3f} s), CPU median {median(times, 1):.3f} s; "
        f"eventflow --version alone (start-up and imports): wall {median(start, 0):.3f} s, "
        f"CPU {median(start, 1):.3f} s"
    )


async def append_cost(args: argparse.Namespace) -> None:
    """Events/s of single-event appends with the correlation index and without it, in
    alternating rounds on one store of each kind; the median ratio."""
    import tempfile

    from eventflow.testing.postgres import with_schema

    n = 2000
    tmp = tempfile.TemporaryDirectory()
    pg = with_schema(args.postgres_url, f"bench_trace_{uuid.uuid4().hex[:8]}")
    for kind, url in (("sqlite", f"sqlite:///{tmp.name}/cost.db"), ("postgresql", pg)):
        store = store_for(url)
        await store.open()
        rates: dict[bool, list[float]] = {True: [], False: []}
        try:
            for r in range(args.rounds):
                indexed = r % 2 == 0
                for sql in _CREATE[kind] if indexed else _DROP[kind]:
                    await _execute(store, kind, sql)
                began = time.perf_counter()
                for i in range(n):
                    env = Envelope.create("bench.trace.cost", {"n": i}, correlation_id=f"c-{r}-{i}")
                    await store.append(f"cost-{r}-{i % 50}", [env])
                rates[indexed].append(n / (time.perf_counter() - began))
        finally:
            await store.close()
            if kind == "postgresql":
                await _drop(url)
        with_index, without = statistics.median(rates[True]), statistics.median(rates[False])
        print(
            f"{kind}: appends/s with the index {with_index:,.0f}, without {without:,.0f} "
            f"(ratio {with_index / without:.3f}, medians of {args.rounds // 2} rounds each)"
        )
    tmp.cleanup()


_CREATE = {
    "sqlite": [
        "CREATE INDEX IF NOT EXISTS ef_events_correlation ON ef_events "
        "(json_extract(CAST(envelope AS TEXT), '$.correlation_id'))"
    ],
    "postgresql": [  # as schema.py makes them
        "CREATE INDEX IF NOT EXISTS ef_events_correlation_id ON ef_events (correlation_id) "
        "WHERE correlation_id IS NOT NULL",
        "CREATE INDEX IF NOT EXISTS ef_events_correlation_stored ON ef_events "
        "(ef_correlation_v1(envelope)) WHERE correlation_id IS NULL",
    ],
}
_DROP = {
    "sqlite": ["DROP INDEX IF EXISTS ef_events_correlation"],
    "postgresql": [
        "DROP INDEX IF EXISTS ef_events_correlation_id",
        "DROP INDEX IF EXISTS ef_events_correlation_stored",
    ],
}


async def _execute(store: Any, kind: str, sql: str) -> None:
    async with store.transaction() as tx:
        await tx.execute(sql)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    parser.add_argument("--lookups", type=int, default=20)
    parser.add_argument(
        "--cli", type=int, default=5, metavar="N", help="run `eventflow trace` N times (0: not)"
    )
    parser.add_argument("--scan", action="store_true", help="also time a whole-log scan")
    parser.add_argument(
        "--old-rows",
        action="store_true",
        help="fill without the correlation_id column (rows an earlier version stored)",
    )
    parser.add_argument("--append-cost", action="store_true", help="the index's cost on appends")
    parser.add_argument("--rounds", type=int, default=6)
    return parser.parse_args()


if __name__ == "__main__":
    _args = _parse()
    asyncio.run(append_cost(_args) if _args.append_cost else main(_args))
