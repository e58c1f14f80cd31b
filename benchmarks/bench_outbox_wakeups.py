"""What waking the outbox relay across processes costs.

- ``notify`` (PostgreSQL): transactions shaped like a handler's inbox transaction (a dedup
  entry and one outbox row, committed), from 1 or 8 concurrent writers, with the store's
  outbox add (which notifies the outbox's channel at commit) against the same row inserted
  without the notification. A notifying commit takes a lock every notifying commit of the
  server takes, and holds it while its commit record is flushed.
- ``idle`` (SQLite): the CPU an idle app uses (no messages at all), with its outbox relay
  checking the file for other processes' adds (the outbox's high-water mark, every
  ``CHECK_MAX`` seconds when idle) against the same app with the checks off (the relay
  then only looks every second), and against a bare event loop that wakes as often as the
  checks do.

    python benchmarks/bench_outbox_wakeups.py notify [--url postgresql://...] [--seconds S]
        [--rounds N] [--writers 1 8]
    python benchmarks/bench_outbox_wakeups.py idle [--seconds S] [--rounds N]

The variants alternate within each round; the medians are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from eventflow import App, Envelope
from eventflow.adapters.postgres import PostgresStore
from eventflow.adapters.sqlite import outbox as sqlite_outbox
from eventflow.envelope import new_id
from eventflow.stores import store_for
from eventflow.testing.postgres import isolated_schema

_PLAIN_ADD = "INSERT INTO ef_outbox (topic, msg_key, payload, message_id) VALUES ($1, $2, $3, $4)"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _writers(store: PostgresStore, writers: int, seconds: float, notify: bool) -> float:
    """Transactions per second of ``writers`` concurrent writers for ``seconds``."""
    payload = Envelope.create("bench.outbox.sent", {"note": "x" * 200})
    stop = time.monotonic() + seconds
    done = 0

    async def write() -> None:
        nonlocal done
        while time.monotonic() < stop:
            env = payload.model_copy(update={"id": new_id()})
            async with store.transaction() as tx:
                await store.mark_handled("bench", env.id, tx)
                if notify:
                    await store.outbox.add([("bench.outbox.sent", env)], tx=tx)
                else:
                    await tx.execute(_PLAIN_ADD, "bench.outbox.sent", None, env.to_bytes(), env.id)
            done += 1

    await asyncio.gather(*(write() for _ in range(writers)))
    return done / seconds


async def bench_notify(url: str, writers: list[int], seconds: float, rounds: int) -> None:
    """Print transactions/s with and without the outbox's notification."""
    async with isolated_schema(url, prefix="bench_notify_") as schema_url:
        store = store_for(f"{schema_url}&pool={max(writers) + 2}")
        assert isinstance(store, PostgresStore)
        await store.open()
        try:
            for n in writers:
                plain: list[float] = []
                notified: list[float] = []
                for _ in range(rounds):
                    plain.append(await _writers(store, n, seconds, notify=False))
                    notified.append(await _writers(store, n, seconds, notify=True))
                p, q = statistics.median(plain), statistics.median(notified)
                print(
                    f"writers={n}: plain insert {p:,.0f} tx/s, outbox add (notifies) "
                    f"{q:,.0f} tx/s: {q / p:.0%} (rounds: {[round(x) for x in plain]} / "
                    f"{[round(x) for x in notified]})",
                    flush=True,
                )
        finally:
            await store.close()


async def _idle_app(folder: Path, seconds: float) -> float:
    """% of a core an idle app on SQLite uses over ``seconds`` (after a warm-up)."""
    app = App(
        "bench-idle",
        broker=f"memory://bench-{uuid.uuid4().hex[:8]}",
        store=f"sqlite:///{folder / f'{uuid.uuid4().hex[:8]}.db'}",
    )
    async with app:
        await asyncio.sleep(1.0)
        return await _cpu_over(asyncio.sleep(seconds), seconds)


async def _cpu_over(work: Awaitable[object], seconds: float) -> float:
    start = _cpu()
    await work
    return 100 * (_cpu() - start) / seconds


async def _bare_loop(seconds: float, interval: float) -> float:
    """% of a core an event loop uses waking every ``interval`` with nothing to do."""

    async def wake() -> None:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            await asyncio.sleep(interval)

    return await _cpu_over(wake(), seconds)


def _checks_off() -> Callable[[], None]:
    """Turn the SQLite outbox's checks off (the relay's 1 s look remains); return undo."""
    saved = sqlite_outbox.CHECK_FIRST, sqlite_outbox.CHECK_MAX
    sqlite_outbox.CHECK_FIRST = sqlite_outbox.CHECK_MAX = 10.0

    def undo() -> None:
        sqlite_outbox.CHECK_FIRST, sqlite_outbox.CHECK_MAX = saved

    return undo


async def bench_idle(seconds: float, rounds: int) -> None:
    """Print the idle CPU of an app on SQLite with and without the checks."""
    on: list[float] = []
    off: list[float] = []
    bare: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(rounds):
            on.append(await _idle_app(Path(folder), seconds))
            undo = _checks_off()
            try:
                off.append(await _idle_app(Path(folder), seconds))
            finally:
                undo()
            bare.append(await _bare_loop(seconds, sqlite_outbox.CHECK_MAX))
    print(
        f"idle app on SQLite: {statistics.median(on):.2f}% of a core with the checks "
        f"(every {sqlite_outbox.CHECK_MAX * 1000:g} ms), {statistics.median(off):.2f}% "
        f"without; a bare loop waking as often: {statistics.median(bare):.2f}%",
        flush=True,
    )


def main() -> None:
    """Run the chosen benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["notify", "idle"])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=3.0, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.what == "notify":
        asyncio.run(bench_notify(args.url, args.writers, args.seconds, args.rounds))
    else:
        asyncio.run(bench_idle(args.seconds, args.rounds))


if __name__ == "__main__":
    main()
