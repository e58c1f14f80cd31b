"""End-to-end throughput on the memory broker, next to the floor measured in the same run.

eventflow: ``app.publish(event)`` -> memory broker -> envelope decode -> typed event
(validate) -> dedup check -> handler -> dedup mark -> ack, one process, one core.

floor: orjson encode + decode of the same envelope through a bounded ``asyncio.Queue``
(a producer task and a consumer task), the least any in-process event bus must do.

    python benchmarks/bench_memory.py [--events 100000] [--keys 100] [--concurrency 1 8]

Prints events/s for each and the ratio eventflow / floor. Absolute numbers vary with the
machine's load; compare the ratio. On a noisy machine, instruction counts are steadier:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        python benchmarks/bench_memory.py --only eventflow --events 20000 --rounds 1 --concurrency 1

(and the same with ``--only floor``; subtract a run with ``--events 1`` from each).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson

from eventflow import App, Context, Event, subscribe
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig

_POOL = 1000


class BenchOrderPlaced(Event, type="bench.order.placed", version=1):
    """The benchmark's event: four fields, like a small real event."""

    order_id: str
    sku: str
    qty: int
    customer_id: str | None = None


def _events(n: int, keys: int) -> Iterator[tuple[BenchOrderPlaced, str]]:
    # A pool of 1,000 distinct events published in turn (each publish makes a new envelope
    # with a new id): like the floor, nothing is built in the timed loop, and no list of
    # 100,000 live objects slows the garbage collector's full passes for eventflow alone.
    pool = [
        (BenchOrderPlaced(order_id=f"o-{i}", sku=f"sku-{i % 50}", qty=1 + i % 5), f"k-{i % keys}")
        for i in range(min(n, _POOL))
    ]
    for i in range(n):
        yield pool[i % len(pool)]


async def bench_eventflow(n: int, keys: int, concurrency: int) -> float:
    """Publish n events and wait until the typed handler saw them all; return events/s."""
    done = asyncio.Event()
    count = 0

    @subscribe("bench.order.placed", group="bench", concurrency=concurrency)
    async def handle(event: BenchOrderPlaced, ctx: Context) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    broker = MemoryBroker(MemoryBrokerConfig(name=f"bench-{uuid.uuid4().hex}"))
    app = App("bench", broker=broker, handlers=[handle])
    events = _events(n, keys)
    gc.collect()
    async with app:
        start = time.perf_counter()
        for event, key in events:
            await app.publish(event, key=key)
        await done.wait()
        elapsed = time.perf_counter() - start
        stats = app.stats()["bench:bench.order.placed"]
        assert stats["handled"] == n and stats["duplicates"] == 0, stats
    return n / elapsed


async def bench_floor(n: int) -> float:
    """orjson encode + decode of the same envelope through a bounded queue; return events/s."""
    env = {
        "id": "01935b2e-8f7a-7c3e-9d4b-5a6f7e8d9c0b",
        "type": "bench.order.placed",
        "version": 1,
        "source": "bench",
        "time": "2026-11-29T12:00:00.000000Z",
        "correlation_id": "01935b2e-8f7a-7c3e-9d4b-5a6f7e8d9c0b",
        "causation_id": None,
        "key": "k-1",
        "headers": {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        "data": {"order_id": "o-1", "sku": "sku-1", "qty": 1, "customer_id": None},
    }
    queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=10_000)
    sink: list[Any] = []

    async def consume() -> None:
        for _ in range(n):
            sink.append(orjson.loads(await queue.get()))
            if len(sink) > 1000:
                sink.clear()

    gc.collect()
    start = time.perf_counter()
    consumer = asyncio.create_task(consume())
    for _ in range(n):
        await queue.put(orjson.dumps(env))
    await consumer
    return n / (time.perf_counter() - start)


def main() -> None:
    """Run floor and eventflow rounds interleaved; print events/s and the ratio per round."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (the median is reported)")
    parser.add_argument(
        "--only",
        choices=["floor", "eventflow"],
        help="run one side once per round, no ratio (for instruction counts under callgrind)",
    )
    args = parser.parse_args()
    if args.only:
        for conc in args.concurrency:
            for _ in range(args.rounds):
                run = (
                    bench_floor(args.events)
                    if args.only == "floor"
                    else bench_eventflow(args.events, args.keys, conc)
                )
                print(f"{args.only} concurrency={conc}: {asyncio.run(run):,.0f} events/s")
        return

    # Interleaving floor and eventflow rounds exposes both to the same machine noise; the
    # median of the per-round ratios is the figure to compare.
    for conc in args.concurrency:
        floors, flows, ratios = [], [], []
        for _ in range(args.rounds):
            floor = asyncio.run(bench_floor(args.events))
            flow = asyncio.run(bench_eventflow(args.events, args.keys, conc))
            floors.append(floor)
            flows.append(flow)
            ratios.append(flow / floor)
        print(
            f"concurrency={conc}: floor (orjson + bounded asyncio.Queue) "
            f"{statistics.median(floors):,.0f} events/s; eventflow (memory broker, dedup on, "
            f"typed handler) {statistics.median(flows):,.0f} events/s; "
            f"ratio {statistics.median(ratios):.0%} (per round: "
            + ", ".join(f"{r:.0%}" for r in ratios)
            + ")"
        )


if __name__ == "__main__":
    main()
