"""What tracing costs end to end: events/s with ``App(tracing=False)`` against tracing on.

Each round publishes ``--events`` events with ``app.publish`` (windows of 200 concurrent
publishes) and waits until one handler (concurrency 1, memory dedup store) handled them
all: a ``send`` span and a ``process`` span per event when tracing is on. Sides, in
alternating rounds on a fresh stream (NATS) or hub (memory) each:

- ``off``: ``App(tracing=False)``: nothing of OpenTelemetry runs (the process imported it,
  for the other sides; a process that does not import it runs the same code as ``off``);
- ``noop``: ``App(tracing=NoOpTracerProvider())``: eventflow's own part (attributes, the
  envelope rewritten with the send span's context, extracting the parent) with the API's
  no-op spans;
- ``sdk``: ``App(tracing=provider)``, the OpenTelemetry SDK with a ``BatchSpanProcessor``
  to an exporter that drops the spans (no I/O): the cost a real deployment pays before its
  exporter's.

    python benchmarks/bench_tracing.py [--events 20000] [--rounds 3]
        [--brokers nats memory] [--sides off noop sdk] [--nats-url URL]

Prints one line per round, then per broker the median events/s per side and the median of
the per-round ratios to ``off``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NoOpTracerProvider

from eventflow import App, Context, Event, subscribe
from eventflow.testing.nats_server import NatsServer

WINDOW = 200


class TracedBench(Event, type="bench.traced", version=1):
    """The benchmark's event: a few fields and a 200-byte note."""

    order_id: str
    qty: int
    note: str


class _Dropping(SpanExporter):
    """Counts the spans and drops them."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


def _tracing(side: str) -> tuple[Any, _Dropping | None, TracerProvider | None]:
    if side == "off":
        return False, None, None
    if side == "noop":
        return NoOpTracerProvider(), None, None
    exporter = _Dropping()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=65_536))
    return provider, exporter, provider


async def run(broker_url: str, side: str, n: int) -> float:
    """One round: events/s from the first publish to the last handling."""
    done = asyncio.Event()
    count = 0

    @subscribe("bench.traced", group="bench")
    async def handle(event: TracedBench, ctx: Context) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    tracing, exporter, provider = _tracing(side)
    events = [TracedBench(order_id=f"o-{i}", qty=1 + i % 5, note="x" * 200) for i in range(n)]
    gc.collect()
    async with App("bench", broker=broker_url, handlers=[handle], tracing=tracing) as app:
        start = time.perf_counter()
        for i in range(0, n, WINDOW):
            await asyncio.gather(
                *(app.publish(e, key=f"k-{j % 100}") for j, e in enumerate(events[i : i + WINDOW]))
            )
        await done.wait()
        elapsed = time.perf_counter() - start
    if provider is not None and exporter is not None:
        provider.force_flush()
        provider.shutdown()
        assert exporter.spans >= 2 * n, (exporter.spans, n)  # a send and a process each
    return n / elapsed


@contextlib.contextmanager
def _nats(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with NatsServer() as server:
        yield server.url


def main() -> None:
    """Alternate the sides round by round on each broker; print events/s and ratios."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--brokers", nargs="+", default=["nats", "memory"])
    parser.add_argument("--sides", nargs="+", default=["off", "noop", "sdk"])
    parser.add_argument("--nats-url", default=None, help="an existing NATS server")
    args = parser.parse_args()

    rates: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    with _nats(args.nats_url if "nats" in args.brokers else "unused") as nats_url:
        for i in range(args.rounds):
            for broker in args.brokers:
                line = []
                by_side = {}
                for side in args.sides:
                    if broker == "nats":
                        url = f"{nats_url}?stream=EF_{uuid.uuid4().hex[:8]}"
                    else:
                        url = f"memory://bench-{uuid.uuid4().hex[:8]}"
                    rate = asyncio.run(run(url, side, args.events))
                    by_side[side] = rate
                    rates.setdefault((broker, side), []).append(rate)
                    line.append(f"{side} {rate:,.0f}/s")
                off = by_side.get("off")
                for side, rate in by_side.items():
                    if off:
                        ratios.setdefault((broker, side), []).append(rate / off)
                print(f"round {i + 1} {broker}: " + ", ".join(line), flush=True)
    for broker in args.brokers:
        parts = []
        for side in args.sides:
            median = statistics.median(rates[(broker, side)])
            ratio = statistics.median(ratios.get((broker, side), [float("nan")]))
            parts.append(f"{side} {median:,.0f}/s (x{ratio:.3f} of off)")
        print(
            f"median over {args.rounds} rounds of {args.events} events, {broker}: "
            + "; ".join(parts)
        )


if __name__ == "__main__":
    main()
