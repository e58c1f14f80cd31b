"""Aggregate load time with and without a snapshot, per event store.

One aggregate whose stream holds ``--events`` events (default 1,000), saved 100 at a time
through a ``Repository``. Then, in the same run and on the same stream:

- replay: ``Repository(Order, store).load(id)`` reads and applies every event;
- snapshot: ``Repository(Order, store, snapshot_every=N).load(id)`` reads the snapshot
  taken at the last save and the events after it (none here).

    python benchmarks/bench_aggregate.py [--events 1000] [--loads 30] [--stores memory sqlite pg]

Prints the median load time of each and the ratio replay / snapshot. PostgreSQL
(``--pg-url``, default ``postgresql://postgres@127.0.0.1/test``) runs when the store URL is
supported and the server answers; otherwise the row says why it was left out. The memory
store keeps decoded events on its records, so its replay cost is mostly the appliers.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from eventflow import Event
from eventflow.ports import Store
from eventflow.sourcing import Aggregate, Repository, on
from eventflow.stores import store_for

BATCH = 100


class BenchLineAdded(Event, type="bench.aggregate.line_added", version=1):
    """A line added to an order: four fields, like a small real event."""

    sku: str
    qty: int
    price_cents: int
    note: str | None = None


class BenchOrder(Aggregate, stream="bench_order"):
    """An order with a little state per event: a dict of lines and running totals."""

    lines: dict[str, int] = {}
    total_cents: int = 0
    count: int = 0

    @on(BenchLineAdded)
    def _line(self, e: BenchLineAdded) -> None:
        self.lines[e.sku] = self.lines.get(e.sku, 0) + e.qty
        self.total_cents += e.qty * e.price_cents
        self.count += 1


async def _fill(store: Store, order_id: str, events: int) -> None:
    repo = Repository(BenchOrder, store, snapshot_every=events)
    order = BenchOrder(id=order_id)
    for i in range(events):
        order.record(BenchLineAdded(sku=f"sku-{i % 50}", qty=1 + i % 5, price_cents=199))
        if len(order.pending) == BATCH:
            await repo.save(order)
    await repo.save(order)


async def _median_load(repo: Repository[BenchOrder], order_id: str, loads: int) -> float:
    await repo.load(order_id)  # warm-up
    times = []
    for _ in range(loads):
        start = time.perf_counter()
        await repo.load(order_id)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def bench_store(url: str, events: int, loads: int) -> tuple[float, float]:
    """Return the median (replay, snapshot) load times in seconds on the store at ``url``."""
    store = store_for(url)
    await store.open()
    try:
        order_id = uuid.uuid4().hex
        await _fill(store, order_id, events)
        replay_repo = Repository(BenchOrder, store)
        snapshot_repo = Repository(BenchOrder, store, snapshot_every=events)
        replayed = await replay_repo.load(order_id)
        restored = await snapshot_repo.load(order_id)
        assert replayed == restored and replayed.version == events, "states differ"
        snapshot = await store.load_snapshot(snapshot_repo.stream_id(order_id))
        assert snapshot is not None and snapshot.version == events, "no snapshot was taken"
        replay = await _median_load(replay_repo, order_id, loads)
        snap = await _median_load(snapshot_repo, order_id, loads)
        return replay, snap
    finally:
        await store.close()


async def main(events: int, loads: int, stores: list[str], pg_url: str) -> None:
    """Run the benchmark on each store and print one row per store."""
    print(f"aggregate load, {events} events, median of {loads} loads")
    print(f"{'store':<10} {'replay ms':>10} {'snapshot ms':>12} {'ratio':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        urls = {
            "memory": "memory://",
            "sqlite": "sqlite:///" + str(Path(tmp) / "bench.db"),
            "pg": pg_url,
        }
        for name in stores:
            try:
                replay, snap = await bench_store(urls[name], events, loads)
            except Exception as exc:  # an unsupported URL or a server that does not answer
                print(f"{name:<10} left out: {type(exc).__name__}: {exc}")
                continue
            ratio = replay / snap
            print(f"{name:<10} {replay * 1e3:>10.2f} {snap * 1e3:>12.2f} {ratio:>7.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--loads", type=int, default=30)
    parser.add_argument("--stores", nargs="+", default=["memory", "sqlite", "pg"])
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1/test")
    args = parser.parse_args()
    asyncio.run(main(args.events, args.loads, args.stores, args.pg_url))
