"""Replay throughput: ``read_all`` over the whole log, and a projection rebuild.

For each store (memory, a SQLite file, PostgreSQL when one answers), appends N events (500
per append, over 100 streams, two thirds of them handled by the projection) and measures:

- ``read_all``: iterating every ``RecordedEvent`` from position 0 (rows -> envelopes);
- ``read_all+decode``: the same, decoding each event (upcast + pydantic validation);
- ``rebuild``: ``ProjectionRunner.rebuild()`` of a projection keeping its state in Python
  (reset, then read_all in batches, decode + handler per event, one checkpoint transaction
  per batch).

    python benchmarks/bench_projections.py [--events 100000] [--batch-size 500]
        [--stores memory sqlite postgresql] [--postgres-url URL] [--repeat 3]

Prints the best events/s of ``--repeat`` runs per store and measurement (other load on the
machine only slows a run down); the target is replay >= 50,000 events/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import tempfile
import time
import uuid
from collections.abc import AsyncIterator

from eventflow import Event
from eventflow.events import default_registry
from eventflow.ports import Store, Transaction
from eventflow.projections import Projection, ProjectionContext, ProjectionRunner
from eventflow.sourcing.on import on
from eventflow.stores import store_for

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1/test"
TARGET = 50_000


class BenchItemAdded(Event, type="bench.proj.item.added"):
    """Handled by the projection."""

    sku: str
    qty: int


class BenchItemRemoved(Event, type="bench.proj.item.removed"):
    """Handled by the projection."""

    sku: str
    qty: int


class BenchItemRenamed(Event, type="bench.proj.item.renamed"):
    """Skipped by the projection (no handler)."""

    sku: str
    name: str


class BenchStock(Projection, name="bench_stock"):
    """Stock levels per sku in a dict."""

    def __init__(self) -> None:
        self.levels: dict[str, int] = {}

    async def reset(self, tx: Transaction) -> None:
        self.levels.clear()

    @on(BenchItemAdded)
    async def _added(self, e: BenchItemAdded, ctx: ProjectionContext) -> None:
        self.levels[e.sku] = self.levels.get(e.sku, 0) + e.qty

    @on(BenchItemRemoved)
    async def _removed(self, e: BenchItemRemoved, ctx: ProjectionContext) -> None:
        self.levels[e.sku] = self.levels.get(e.sku, 0) - e.qty


def _event(i: int) -> Event:
    sku = f"sku-{i % 50}"
    if i % 3 == 0:
        return BenchItemAdded(sku=sku, qty=1 + i % 5)
    if i % 3 == 1:
        return BenchItemRemoved(sku=sku, qty=1)
    return BenchItemRenamed(sku=sku, name=f"n-{i}")


@contextlib.asynccontextmanager
async def _store(kind: str, postgres_url: str) -> AsyncIterator[Store]:
    if kind == "memory":
        store = store_for("memory://")
    elif kind == "sqlite":
        tmp = tempfile.TemporaryDirectory()
        store = store_for(f"sqlite:///{tmp.name}/bench.db")
    else:
        from eventflow.testing.postgres import with_schema

        store = store_for(with_schema(postgres_url, f"bench_{uuid.uuid4().hex[:10]}"))
    await store.open()
    try:
        yield store
    finally:
        await store.close()
        if kind == "sqlite":
            tmp.cleanup()


async def _drop_schema(url: str) -> None:
    import asyncpg  # the postgres extra

    from eventflow.testing.postgres import _admin_dsn

    schema = dict(p.split("=", 1) for p in url.split("?", 1)[1].split("&"))["schema"]
    conn = await asyncpg.connect(_admin_dsn(url))
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def _fill(store: Store, n: int) -> None:
    per_append = 500
    for start in range(0, n, per_append):
        count = min(per_append, n - start)
        await store.append(
            f"item-{start // per_append % 100}", [_event(i) for i in range(start, start + count)]
        )
    deadline = time.monotonic() + 60
    while await store.last_position() < n:  # PostgreSQL numbers events just after commit
        if time.monotonic() > deadline:
            raise RuntimeError("the store did not number every appended event within 60 s")
        await asyncio.sleep(0.01)


async def _timed_read(store: Store, decode: bool) -> tuple[int, float]:
    gc.collect()
    n = 0
    start = time.perf_counter()
    async for rec in store.read_all(after=0):
        if decode:  # not rec.event: the memory store's records cache their decoded event
            default_registry.decode(rec.envelope)
        n += 1
    return n, time.perf_counter() - start


async def bench_store(
    kind: str, n: int, batch_size: int, postgres_url: str, repeat: int = 3
) -> dict[str, float]:
    """Fill one store with n events; return the best events/s of ``repeat`` runs of each."""
    results: dict[str, float] = {}
    async with _store(kind, postgres_url) as store:
        try:
            await _fill(store, n)
            for _ in range(repeat):  # best of `repeat`: the machine's other load only slows
                for label, decode in (("read_all", False), ("read_all+decode", True)):
                    count, seconds = await _timed_read(store, decode)
                    assert count == n, f"read_all returned {count} of {n} events"
                    results[label] = max(results.get(label, 0.0), count / seconds)
                projection = BenchStock()
                gc.collect()
                start = time.perf_counter()
                last = await ProjectionRunner(projection, store, batch_size=batch_size).rebuild()
                seconds = time.perf_counter() - start
                assert last == n and sum(projection.levels.values()) != 0
                results["rebuild"] = max(results.get("rebuild", 0.0), n / seconds)
        finally:
            if kind == "postgresql":
                await store.close()  # stops its sequencer first (close is idempotent)
                await _drop_schema(store.url)
    return results


async def _postgres_answers(url: str) -> bool:
    try:
        import asyncpg
    except ImportError:
        return False
    try:
        conn = await asyncio.wait_for(asyncpg.connect(url), 3)
    except Exception:
        return False
    await conn.close()
    return True


async def main(args: argparse.Namespace) -> int:
    """Run the benchmark for each store asked for; return 1 if replay misses the target."""
    print(f"{args.events:,} events, batch size {args.batch_size}")
    worst = float("inf")
    for kind in args.stores:
        if kind == "postgresql" and not await _postgres_answers(args.postgres_url):
            print(f"{kind:<11} no server answers at {args.postgres_url}: not measured")
            continue
        results = await bench_store(
            kind, args.events, args.batch_size, args.postgres_url, args.repeat
        )
        for label, rate in results.items():
            print(f"{kind:<11} {label:<16} {rate:>12,.0f} events/s")
        worst = min(worst, results["read_all"], results["rebuild"])
    if worst < TARGET:
        print(f"below the target of {TARGET:,} events/s")
        return 1
    print(f"every replay and rebuild >= {TARGET:,} events/s")
    return 0


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--stores",
        nargs="+",
        default=["memory", "sqlite", "postgresql"],
        choices=["memory", "sqlite", "postgresql"],
    )
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    return parser.parse_args()


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(_parse())))
