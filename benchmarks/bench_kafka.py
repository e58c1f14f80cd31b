"""End-to-end throughput on Kafka (Tansu): eventflow next to raw aiokafka and FastStream.

Each round publishes ``--events`` messages (200-byte payloads, ``--keys`` keys) to a fresh
8-partition topic and times publish -> consume -> handler -> commit until the handler has
seen them all, for three stacks on the same server:

- eventflow: ``app.publish(event)`` -> KafkaBroker -> envelope decode -> typed event
  (validated) -> dedup check (memory store) -> empty handler -> dedup mark -> ack; offsets
  committed by the adapter (contiguous finished offsets, every ``commit_interval``).
- raw aiokafka: producer ``send`` of the same envelope bytes; a consumer in a group with
  ``getmany`` -> ``orjson.loads`` per message -> empty handler -> ``commit()`` per batch.
- FastStream: ``broker.publish`` of the same bytes; a ``@broker.subscriber`` in a group
  with ``ack_policy=ACK`` (commit after handling), handler typed with a pydantic model.

All three publish with the same window of concurrent sends. Rounds are interleaved (the
machine is shared and noisy); the median of per-round ratios is reported.

    python benchmarks/bench_kafka.py [--events 20000] [--rounds 3] [--url kafka://...]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from pydantic import BaseModel

from eventflow import App, Context, Event, subscribe
from eventflow.adapters.kafka import KafkaBroker, KafkaBrokerConfig
from eventflow.events import to_envelope
from eventflow.testing.kafka_server import KafkaServer

PARTITIONS = 8
WINDOW = 500  # concurrent sends in flight, for every stack
PAYLOAD = "x" * 160  # with the other fields, ~200 bytes of event data


class BenchOrder(Event, type="bench.kafka.order", version=1):
    """The benchmark's event: ~200 bytes of data."""

    order_id: str
    sku: str
    qty: int
    note: str


class OrderModel(BaseModel):
    """FastStream's typed view of the same message."""

    id: str
    type: str
    data: dict[str, Any]


def _events(n: int) -> list[BenchOrder]:
    return [
        BenchOrder(order_id=f"o-{i:08d}", sku=f"sku-{i % 50}", qty=1, note=PAYLOAD)
        for i in range(n)
    ]


def _wire(n: int, keys: int) -> list[tuple[bytes, bytes]]:
    out = []
    for i, event in enumerate(_events(n)):
        env = to_envelope(event, source="bench", key=f"k-{i % keys}")
        out.append((env.to_bytes(), f"k-{i % keys}".encode()))
    return out


async def _windowed(n: int, send: Callable[[int], Awaitable[Any]]) -> None:
    for start in range(0, n, WINDOW):
        await asyncio.gather(*(send(i) for i in range(start, min(n, start + WINDOW))))


async def _create_topic(bootstrap: str, topic: str) -> None:
    broker = KafkaBroker(KafkaBrokerConfig(bootstrap_servers=(bootstrap,), partitions=PARTITIONS))
    async with broker:
        await broker.ensure_topics([topic])


async def bench_eventflow(bootstrap: str, n: int, keys: int, concurrency: int) -> float:
    """Publish n events through an App and wait until the typed handler saw all; events/s."""
    topic = f"bench.ef.{uuid.uuid4().hex[:8]}"
    await _create_topic(bootstrap, topic)
    done = asyncio.Event()
    count = 0

    # A topic of its own per round (published to with topic=), so its typed events arrive
    # on a topic not named after their type.
    @subscribe(topic, group=f"g-{topic}", concurrency=concurrency, any_topic=True)
    async def handle(event: BenchOrder, ctx: Context) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    config = KafkaBrokerConfig(bootstrap_servers=(bootstrap,), partitions=PARTITIONS)
    app = App("bench", broker=KafkaBroker(config), handlers=[handle])
    events = _events(n)
    gc.collect()
    async with app:
        start = time.perf_counter()
        await _windowed(n, lambda i: app.publish(events[i], key=f"k-{i % keys}", topic=topic))
        await done.wait()
        elapsed = time.perf_counter() - start
        stats = app.stats()[f"g-{topic}:{topic}"]
        assert stats["handled"] == n and stats["duplicates"] == 0, stats
    return n / elapsed


async def bench_raw(bootstrap: str, n: int, keys: int) -> float:
    """aiokafka producer + group consumer: getmany, decode, empty handler, commit per batch."""
    topic = f"bench.raw.{uuid.uuid4().hex[:8]}"
    await _create_topic(bootstrap, topic)
    wire = _wire(n, keys)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"g-{topic}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await producer.start()
    await consumer.start()
    while not consumer.assignment():
        await consumer.getmany(timeout_ms=50)

    async def handler(_: Any) -> None:
        return None

    async def consume() -> None:
        seen = 0
        while seen < n:
            batch = await consumer.getmany(timeout_ms=200, max_records=1000)
            for records in batch.values():
                for rec in records:
                    await handler(orjson.loads(rec.value))
                    seen += 1
            if batch:
                await consumer.commit()

    async def send(i: int) -> None:
        value, key = wire[i]
        await (await producer.send(topic, value, key=key, headers=[("eventflow-id", b"x")]))

    gc.collect()
    try:
        start = time.perf_counter()
        reader = asyncio.create_task(consume())
        await _windowed(n, send)
        await reader
        return n / (time.perf_counter() - start)
    finally:
        await consumer.stop()
        await producer.stop()


async def bench_faststream(bootstrap: str, n: int, keys: int) -> float:
    """FastStream KafkaBroker: publish bytes; subscriber in a group, commit after handling."""
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker as FastStreamBroker

    topic = f"bench.fs.{uuid.uuid4().hex[:8]}"
    await _create_topic(bootstrap, topic)
    wire = _wire(n, keys)
    broker = FastStreamBroker(bootstrap, logger=None)
    done = asyncio.Event()
    count = 0

    @broker.subscriber(
        topic, group_id=f"g-{topic}", auto_offset_reset="earliest", ack_policy=AckPolicy.ACK
    )
    async def handle(msg: OrderModel) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    await broker.start()
    try:
        await asyncio.sleep(3.0)  # FastStream offers no "assigned" signal; earliest covers it

        async def send(i: int) -> None:
            value, key = wire[i]
            await broker.publish(value, topic, key=key)

        gc.collect()
        start = time.perf_counter()
        await _windowed(n, send)
        await done.wait()
        return n / (time.perf_counter() - start)
    finally:
        await broker.stop()


def main() -> None:
    """Run the three stacks in interleaved rounds and print events/s and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", default=None, help="kafka://host:port (default: start Tansu)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    logging.getLogger("eventflow.kafka").setLevel(logging.ERROR)
    size = len(_wire(1, 1)[0][0])
    data = len(orjson.dumps(_events(1)[0].model_dump()))
    print(f"message: {size} bytes on the wire ({data} bytes of event data), {args.events} events")

    server = None
    if args.url:
        bootstrap = args.url.removeprefix("kafka://").split("?")[0]
    else:
        server = KafkaServer()
        server.start()
        bootstrap = server.bootstrap
    try:
        flows, raws, fasts = [], [], []
        for r in range(args.rounds):
            raw = asyncio.run(bench_raw(bootstrap, args.events, args.keys))
            flow = asyncio.run(bench_eventflow(bootstrap, args.events, args.keys, args.concurrency))
            fast = asyncio.run(bench_faststream(bootstrap, args.events, args.keys))
            raws.append(raw)
            flows.append(flow)
            fasts.append(fast)
            print(
                f"round {r + 1}: raw aiokafka {raw:,.0f}/s, eventflow {flow:,.0f}/s, "
                f"FastStream {fast:,.0f}/s; eventflow/raw {flow / raw:.2f}x, "
                f"eventflow/FastStream {flow / fast:.2f}x"
            )
        vs_raw = statistics.median(f / r for f, r in zip(flows, raws, strict=True))
        vs_fast = statistics.median(f / s for f, s in zip(flows, fasts, strict=True))
        print(
            f"median: raw aiokafka {statistics.median(raws):,.0f} events/s; eventflow "
            f"(concurrency={args.concurrency}, dedup on, typed handler) "
            f"{statistics.median(flows):,.0f} events/s; FastStream "
            f"{statistics.median(fasts):,.0f} events/s"
        )
        print(
            f"ratios (median of rounds): eventflow/raw aiokafka {vs_raw:.2f}x (target >= 0.6x), "
            f"eventflow/FastStream {vs_fast:.2f}x (target >= 2x)"
        )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
