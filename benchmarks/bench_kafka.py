"""End-to-end throughput on Kafka (Tansu): eventflow next to raw aiokafka and FastStream.

Each round publishes ``--events`` messages (200-byte payloads, ``--keys`` keys) to a fresh
8-partition topic and times publish -> consume -> handling -> commit until every message was
handled, for three stacks on the same server. Each does the same work per message
(``_work.py`` holds the baselines' part): decode the JSON envelope, check the id in a dedup
store, validate the payload with the event model, call an empty handler, record the id;
offsets are committed after handling.

- eventflow: ``app.publish(event)`` -> KafkaBroker -> envelope decode -> dedup check ->
  typed event (``BenchOrder``, validated) -> handler (counts) -> dedup mark -> ack; offsets
  committed by the adapter (contiguous finished offsets, every ``commit_interval``);
  ``--concurrency 8`` workers, one key at a time each.
- raw aiokafka: producer ``send`` of an envelope of the same fields and size, encoded in
  the timed loop as a hand-written producer would (``_encode``: a random id, the time, the
  event's JSON data, orjson); a consumer in a group with ``getmany``; the records of each
  partition in turn through ``Work.handle`` (``orjson.loads``, type check, dedup lookup,
  ``BenchOrder.model_validate(data)``, empty handler, dedup record), the partitions of a
  batch at the same time (per-key order kept, as eventflow keeps it); ``commit()`` after
  each batch.
- FastStream: ``broker.publish`` of such bytes (``_encode``, in the timed loop too); a
  ``@broker.subscriber`` in a group with ``ack_policy=ACK`` (commit after handling);
  FastStream decodes the body and validates it as ``Wire[BenchOrder]`` (the envelope's id,
  type and the event model as ``data``); the handler does the dedup lookup, the empty
  handler and the dedup record.

The dedup store is eventflow's memory store and a Python set for the baselines, or with
``--store postgresql://...`` PostgreSQL for all three: eventflow's store in a schema of its
own per round, and for the baselines the same statements (``SELECT EXISTS`` before,
``INSERT ... ON CONFLICT DO NOTHING`` after) on a table of the same shape, also in a fresh
schema per round; the schemas are dropped after each run.

All three publish with the same window of concurrent sends, from event objects made before
the timing; each builds its envelope bytes inside it (eventflow in ``app.publish``). Before,
the baselines' bytes were made before the timing, which left ~10 us per message of
encoding out of their figures only. The raw producer keeps aiokafka's defaults (16 KiB
batches; eventflow's adapter uses 64 KiB, ``batch_bytes``): ``--raw-batch-bytes 65536`` gives it
the same. Rounds are interleaved (the machine is shared and noisy); the median of per-round
ratios is reported.

    python benchmarks/bench_kafka.py [--events 20000] [--rounds 3] [--url kafka://...]
    python benchmarks/bench_kafka.py --store postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from _work import Wire, Work, drop_schema, fresh_schema, open_dedup, settled, with_schema
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

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


# FastStream's typed view of the envelope: the event model validates ``data``.
FsOrder = Wire[BenchOrder]


def _events(n: int) -> list[BenchOrder]:
    return [
        BenchOrder(order_id=f"o-{i:08d}", sku=f"sku-{i % 50}", qty=1, note=PAYLOAD)
        for i in range(n)
    ]


def _encode(event: BenchOrder, key: str) -> bytes:
    """The envelope as a hand-written producer encodes it (the baselines, in the timed
    loop): eventflow's fields, with a random hex id (``uuid4()`` formatting costs more than
    eventflow's ids) and the time, the event's JSON data."""
    mid = os.urandom(16).hex()
    return orjson.dumps(
        {
            "id": mid,
            "type": BenchOrder.event_type,
            "version": BenchOrder.event_version,
            "source": "bench",
            "time": datetime.now(UTC),
            "correlation_id": mid,
            "causation_id": None,
            "key": key,
            "headers": {"traceparent": f"00-{mid}-{mid[16:]}-01"},
            "data": event.model_dump(mode="json"),
        },
        option=orjson.OPT_UTC_Z,
    )


async def _windowed(n: int, send: Callable[[int], Awaitable[Any]]) -> None:
    for start in range(0, n, WINDOW):
        await asyncio.gather(*(send(i) for i in range(start, min(n, start + WINDOW))))


async def _create_topic(bootstrap: str, topic: str) -> None:
    broker = KafkaBroker(KafkaBrokerConfig(bootstrap_servers=(bootstrap,), partitions=PARTITIONS))
    async with broker:
        await broker.ensure_topics([topic])


async def bench_eventflow(
    bootstrap: str, n: int, keys: int, concurrency: int, store: str | None
) -> float:
    """Publish n events through an App (memory store, or ``store`` in a fresh schema) and
    wait until the typed handler saw all; events/s."""
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
    schema = fresh_schema("bench_ef")
    app = App(
        "bench",
        broker=KafkaBroker(config),
        store=with_schema(store, schema) if store else "memory://",
        handlers=[handle],
    )
    events = _events(n)
    gc.collect()
    try:
        async with app:
            start = time.perf_counter()
            await _windowed(n, lambda i: app.publish(events[i], key=f"k-{i % keys}", topic=topic))
            await done.wait()
            elapsed = time.perf_counter() - start
            stats = await settled(lambda: app.stats()[f"g-{topic}:{topic}"], n)
            assert stats["handled"] == n and stats["duplicates"] == 0, stats
    finally:
        if store:
            await drop_schema(store, schema)
    return n / elapsed


async def bench_raw(
    bootstrap: str, n: int, keys: int, store: str | None, batch_bytes: int = 16384
) -> float:
    """aiokafka producer + group consumer: getmany, ``Work.handle`` per record (partitions
    at the same time), commit per batch."""
    topic = f"bench.raw.{uuid.uuid4().hex[:8]}"
    await _create_topic(bootstrap, topic)
    events = _events(n)
    work = Work(BenchOrder, BenchOrder.event_type, n, await open_dedup(store, "raw"))
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", max_batch_size=batch_bytes)
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

    async def partition(records: list[Any]) -> None:
        for rec in records:
            await work.handle(rec.value)

    async def consume() -> None:
        while not work.done.is_set():
            batch = await consumer.getmany(timeout_ms=200, max_records=1000)
            if batch:
                await asyncio.gather(*(partition(records) for records in batch.values()))
                await consumer.commit()

    async def send(i: int) -> None:
        key = f"k-{i % keys}"
        value = _encode(events[i], key)
        await (
            await producer.send(topic, value, key=key.encode(), headers=[("eventflow-id", b"x")])
        )

    gc.collect()
    try:
        start = time.perf_counter()
        reader = asyncio.create_task(consume())
        await _windowed(n, send)
        await reader
        elapsed = time.perf_counter() - start
        assert work.duplicates == 0, work.duplicates
        return n / elapsed
    finally:
        await consumer.stop()
        await producer.stop()
        if work.dedup is not None:
            await work.dedup.close()


async def bench_faststream(bootstrap: str, n: int, keys: int, store: str | None) -> float:
    """FastStream KafkaBroker: publish bytes; a typed subscriber in a group doing the dedup
    lookup and record, commit after handling."""
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker as FastStreamBroker

    topic = f"bench.fs.{uuid.uuid4().hex[:8]}"
    await _create_topic(bootstrap, topic)
    events = _events(n)
    work = Work(BenchOrder, BenchOrder.event_type, n, await open_dedup(store, "fs"))
    broker = FastStreamBroker(bootstrap, logger=None)

    @broker.subscriber(
        topic, group_id=f"g-{topic}", auto_offset_reset="earliest", ack_policy=AckPolicy.ACK
    )
    async def handle(msg: FsOrder) -> None:
        # FastStream decoded and validated it; the dedup lookup and record are ours.
        await work.handle_decoded(msg.id, msg.data)

    await broker.start()
    try:
        await asyncio.sleep(3.0)  # FastStream offers no "assigned" signal; earliest covers it

        async def send(i: int) -> None:
            key = f"k-{i % keys}"
            await broker.publish(_encode(events[i], key), topic, key=key.encode())

        gc.collect()
        start = time.perf_counter()
        await _windowed(n, send)
        await work.done.wait()
        elapsed = time.perf_counter() - start
        assert work.duplicates == 0, work.duplicates
        return n / elapsed
    finally:
        await broker.stop()
        if work.dedup is not None:
            await work.dedup.close()


def main() -> None:
    """Run the three stacks in interleaved rounds and print events/s and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--raw-batch-bytes",
        type=int,
        default=16384,
        help="the raw aiokafka producer's max_batch_size (aiokafka's default 16384; "
        "eventflow's batch_bytes is 65536)",
    )
    parser.add_argument("--url", default=None, help="kafka://host:port (default: start Tansu)")
    parser.add_argument(
        "--store",
        default=None,
        help="dedup in PostgreSQL for all three, e.g. postgresql://postgres@127.0.0.1:5432/test "
        "(a fresh schema per run; default: memory)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    logging.getLogger("eventflow.kafka").setLevel(logging.ERROR)
    event = _events(1)[0]
    size = len(to_envelope(event, source="bench", key="k-0").to_bytes())
    assert abs(len(_encode(event, "k-0")) - size) < 16, "the baselines' envelopes differ in size"
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
            raw = asyncio.run(
                bench_raw(bootstrap, args.events, args.keys, args.store, args.raw_batch_bytes)
            )
            flow = asyncio.run(
                bench_eventflow(bootstrap, args.events, args.keys, args.concurrency, args.store)
            )
            fast = asyncio.run(bench_faststream(bootstrap, args.events, args.keys, args.store))
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
            f"(concurrency={args.concurrency}, typed handler) "
            f"{statistics.median(flows):,.0f} events/s; FastStream "
            f"{statistics.median(fasts):,.0f} events/s"
        )
        print(
            f"ratios (median of rounds, dedup {'PostgreSQL' if args.store else 'memory'}, the "
            f"same work per message on all three): eventflow/raw aiokafka {vs_raw:.2f}x "
            f"(about 0.5x before issue 13), eventflow/FastStream {vs_fast:.2f}x (about 2x)"
        )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
