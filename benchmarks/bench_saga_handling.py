"""The saga layer alone: the runtime's handling of one order's four inputs (the start event
and three replies of ``bench_sagas.BenchOrderSaga``) on a store, no broker.

Each input goes through ``Handling.message`` in a store transaction, as the saga handler
applies it (with its commit hook, so the saga joins the recent ones), and its commands go to
the outbox with the save (on PostgreSQL in its append's statement). ``--concurrency``
orders at once. Prints orders/s and this process's CPU time per
order. On a noisy machine count instructions instead (deterministic, the saga layer's and
the memory store's Python):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/bench_saga_handling.py --store memory --orders 300

and the same with ``--orders 100``: (instructions of 300 - of 100) / 200 per order.
``--mark`` also records each input's dedup entry in its transaction, as the consumer does
around the saga's handler (on PostgreSQL it rides on the append, and a handling that
guessed its saga is one statement without BEGIN and COMMIT), and has the version checked
at the commit, as the runtime's handler does (on SQLite the append travels with the
COMMIT).

    python benchmarks/bench_saga_handling.py [--store memory|sqlite|postgres] [--orders 300]
        [--concurrency 8] [--postgres-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import bench_sagas as bench
from _work import drop_schema, fresh_schema, with_schema

from eventflow.envelope import Envelope
from eventflow.events import Event, EventRegistry, envelope_for
from eventflow.ports import Store
from eventflow.sagas.runtime import Sagas
from eventflow.stores import open_store

WARM_UP = 50
GROUP = "saga.bench"


async def _order(sagas: Sagas, store: Store, order_id: str, mark: bool = False) -> None:
    """The four inputs of one order, each as the saga handler applies it."""
    inputs: list[Event] = [
        bench.OrderPlaced(order_id=order_id, sku="s", qty=1, amount=5),
        bench.StockReserved(order_id=order_id),
        bench.PaymentCharged(order_id=order_id, charge_id="c"),
        bench.OrderShipped(order_id=order_id),
    ]
    handling, definition = sagas.handling, bench.BenchOrderSaga.definition
    # The group whose entry rides on the save (code before that knows no group= argument),
    # and the version checked at the commit, as the runtime's handler asks (SQLite: the
    # append travels with the COMMIT; the bench's guesses always hold).
    takes = inspect.signature(handling.message).parameters
    extra: dict[str, object] = {"group": GROUP} if mark and "group" in takes else {}
    if extra and "checked_at_commit" in takes:
        extra["checked_at_commit"] = True
    cause: str | None = None
    for event in inputs:
        env = envelope_for(event, source="bench", key=order_id, causation_id=cause)
        env = Envelope.from_bytes(env.to_bytes())  # as the consumer decodes it
        committed: list[Callable[[], None]] = []
        async with store.transaction() as tx:
            # The commands go to the outbox with the save (send=True), as the runtime's
            # handler queues them.
            machine = await handling.message(
                tx,
                bench.BenchOrderSaga,
                event,
                env,
                after_commit=committed.append,
                send=True,
                **extra,
            )
            assert machine is not None
            if mark:  # as the consumer's settlement does, before the commit
                await store.mark_handled(GROUP, env.id, tx)
        sends = handling.sends(definition, machine, env)
        for call in committed:
            call()
        cause = sends[0][1].id if sends else None


async def run(url: str, orders: int, concurrency: int, mark: bool = False) -> None:
    """Warm up, then handle ``orders`` orders, ``concurrency`` at once; print the figures."""
    bench._probe = bench.Probe(asyncio.Semaphore(10**9), 10**9)  # BenchOrderSaga reports here
    async with open_store(url) as store:
        sagas = Sagas(store, EventRegistry(), "bench")
        await sagas.persistence.setup()
        tag = uuid.uuid4().hex[:8]
        limit = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with limit:
                await _order(sagas, store, f"{tag}-{i}", mark)

        await asyncio.gather(*(one(i) for i in range(WARM_UP)))
        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(WARM_UP, WARM_UP + orders)))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = max(orders, 1)
    print(
        f"{url.split(':')[0]}: {orders} orders at concurrency {concurrency}: "
        f"{orders / max(wall, 1e-9):,.0f} orders/s, CPU {cpu / n * 1e3:.2f} ms/order",
        flush=True,
    )


def main() -> None:
    """Parse the arguments, make the store, run."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--store", choices=["memory", "sqlite", "postgres"], default="memory")
    parser.add_argument("--orders", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--postgres-url", default=bench.DEFAULT_POSTGRES_URL)
    parser.add_argument(
        "--mark", action="store_true", help="record each input's dedup entry, as the consumer"
    )
    args = parser.parse_args()
    if args.store == "memory":
        asyncio.run(run("memory://", args.orders, args.concurrency, args.mark))
    elif args.store == "sqlite":
        with tempfile.TemporaryDirectory(prefix="bench-saga-handling-") as tmp:
            url = f"sqlite:///{Path(tmp) / 'bench.db'}"
            asyncio.run(run(url, args.orders, args.concurrency, args.mark))
    else:
        schema = fresh_schema("bench_saga_handling")
        try:
            url = with_schema(args.postgres_url, schema)
            asyncio.run(run(url, args.orders, args.concurrency, args.mark))
        finally:
            asyncio.run(drop_schema(args.postgres_url, schema))


if __name__ == "__main__":
    main()
