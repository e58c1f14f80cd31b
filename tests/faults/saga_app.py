"""Sagas and participants for the saga fault tests, and the saga process they kill.

    PYTHONPATH=.:tests python tests/faults/saga_app.py BROKER_URL STORE_URL SAGA

runs ``App("fx-sagas", sagas=[...])`` with the sagas named in SAGA (``order``, ``late``,
``timer``, ``quick``, ``heldreply``, comma separated) until SIGTERM, printing ``ready`` once its
subscriptions are live. The tests SIGKILL it, SIGSTOP it and start it again.

The participants (:func:`participants`) run in the test's own process, on a store of their
own, and write each effect as a row of ``fx_effects`` inside ``ctx.transaction()``: the
table has no unique key, so only eventflow's inbox keeps an effect from being applied twice.
An order's outcome is in its id: ``o-007-ok`` (everything succeeds), ``-declined`` (the
payment is declined), ``-rejected`` (no stock), ``-late`` (shipping never answers; these
run in ``FxLateSaga``, whose shipping deadline is short).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import asyncpg

from eventflow import App, Context, Event, Saga, on_timer, step, subscribe
from eventflow.testing import unique_name
from eventflow.testing.postgres import isolated_schema, postgres_url
from faults.children import Child, launch, serve

SHIP_TIMEOUT = 60.0
"""Seconds the order saga waits for shipping: above what a storm of kills delays a reply by
(each kill holds the dead process's messages and partitions for a second or two; 32 s seen).
Shorter, a reply that reached the broker before the deadline can lose to the timeout after
a restart: see ``test_a_reply_in_a_killed_members_partition_before_the_deadline_wins``."""
LATE_SHIP_TIMEOUT = 2.0
"""Seconds the late-order saga waits for shipping that never comes."""
QUICK_TIMEOUT = 1.0
"""Seconds the quick saga waits for its one step."""
HELD_REPLY_TIMEOUT = 3.0
"""Seconds the held-reply saga waits for its one step: room for the test to publish the
replies before the deadlines on a loaded machine, and under the claims' expiry after a kill
(``HELD_REPLY_ACK_WAIT``)."""
HELD_REPLY_ACK_WAIT = 3.0
"""``ack_wait`` of the held-reply test's stream: a killed member's partitions pass on about
4.75 s after the kill (``lease_ttl``, see :func:`nats_saga_url`), past the deadlines."""
HOLD_TIMEOUT = 6.0
"""Seconds the timer saga's step waits for an answer that never comes."""

# -- the order saga --------------------------------------------------------------------------


class FxOrderPlaced(Event, type="fxsaga.order.placed"):
    order_id: str


class FxReserve(Event, type="fxsaga.stock.reserve"):
    order_id: str


class FxReserved(Event, type="fxsaga.stock.reserved"):
    order_id: str


class FxNoStock(Event, type="fxsaga.stock.rejected"):
    order_id: str


class FxRelease(Event, type="fxsaga.stock.release"):
    order_id: str


class FxCharge(Event, type="fxsaga.payment.charge"):
    order_id: str


class FxCharged(Event, type="fxsaga.payment.charged"):
    order_id: str
    charge_id: str


class FxDeclined(Event, type="fxsaga.payment.declined"):
    order_id: str


class FxRefund(Event, type="fxsaga.payment.refund"):
    order_id: str


class FxRefunded(Event, type="fxsaga.payment.refunded"):
    order_id: str


class FxShip(Event, type="fxsaga.shipping.ship"):
    order_id: str


class FxShipped(Event, type="fxsaga.shipping.shipped"):
    order_id: str


class FxLatePlaced(Event, type="fxsaga.lateorder.placed"):
    order_id: str


def _order_saga(name: str, start: type[FxOrderPlaced | FxLatePlaced], ship_timeout: float) -> Any:
    class OrderSaga(Saga, name=name, start=start, key="order_id"):
        """Reserve, charge, ship; the refund is a compensation with a reply (waited for
        before the stock is released)."""

        order_id: str = ""
        charge_id: str | None = None

        def started(self, e: FxOrderPlaced | FxLatePlaced) -> None:
            self.order_id = e.order_id

        @step(reply=FxReserved, reject=FxNoStock, timeout=60.0)
        def reserve(self) -> Event:
            return FxReserve(order_id=self.order_id)

        @reserve.compensate
        def release(self) -> Event:
            return FxRelease(order_id=self.order_id)

        @step(reply=FxCharged, reject=FxDeclined, timeout=60.0)
        def charge(self) -> Event:
            return FxCharge(order_id=self.order_id)

        @charge.on_reply
        def _charged(self, e: FxCharged) -> None:
            self.charge_id = e.charge_id

        @charge.compensate(reply=FxRefunded, timeout=60.0)
        def refund(self) -> Event:
            return FxRefund(order_id=self.order_id)

        @step(reply=FxShipped, timeout=ship_timeout)
        def ship(self) -> Event:
            return FxShip(order_id=self.order_id)

    return OrderSaga


FxOrderSaga: type[Saga] = _order_saga("fxorder", FxOrderPlaced, SHIP_TIMEOUT)
"""The orders that are shipped (or fail before): a deadline no kill storm reaches."""
FxLateSaga: type[Saga] = _order_saga("fxlate", FxLatePlaced, LATE_SHIP_TIMEOUT)
"""The same saga for the orders nobody ships: a short deadline, to time out under the kills."""


class FxQuickPlaced(Event, type="fxsaga.quick.placed"):
    order_id: str


class FxHeldReplyPlaced(Event, type="fxsaga.heldreply.placed"):
    order_id: str


def _ship_saga(name: str, start: type[FxQuickPlaced | FxHeldReplyPlaced], timeout: float) -> Any:
    class ShipSaga(Saga, name=name, start=start, key="order_id"):
        """One step with a deadline, shipped by a participant the test holds back."""

        order_id: str = ""

        def started(self, e: FxQuickPlaced | FxHeldReplyPlaced) -> None:
            self.order_id = e.order_id

        @step(reply=FxShipped, timeout=timeout)
        def ship(self) -> Event:
            return FxShip(order_id=self.order_id)

    return ShipSaga


FxQuickSaga: type[Saga] = _ship_saga("fxquick", FxQuickPlaced, QUICK_TIMEOUT)
"""One step with a short deadline."""
FxHeldReplySaga: type[Saga] = _ship_saga("fxheldreply", FxHeldReplyPlaced, HELD_REPLY_TIMEOUT)
"""The same with a longer deadline, for the test whose replies must reach the broker before
their deadlines while a killed member holds them."""


# -- the timer saga --------------------------------------------------------------------------


class FxHoldPlaced(Event, type="fxsaga.hold.placed"):
    hold_id: str
    remind_in: float


class FxHold(Event, type="fxsaga.hold.hold"):
    hold_id: str


class FxHeld(Event, type="fxsaga.hold.held"):
    hold_id: str


class FxRemind(Event, type="fxsaga.hold.remind"):
    hold_id: str


class FxUnhold(Event, type="fxsaga.hold.unhold"):
    hold_id: str


class FxTimerSaga(Saga, name="fxtimer", start=FxHoldPlaced, key="hold_id"):
    """Two timers per saga: a named one (``remind``, due ``remind_in`` seconds after the
    start; its method sends ``FxRemind``) and the step's deadline (nobody answers ``FxHold``:
    it times out and ``FxUnhold`` compensates it)."""

    hold_id: str = ""

    def started(self, e: FxHoldPlaced) -> None:
        self.hold_id = e.hold_id
        self.set_timer("remind", e.remind_in)

    @step(reply=FxHeld, timeout=HOLD_TIMEOUT)
    def hold(self) -> Event:
        return FxHold(hold_id=self.hold_id)

    @hold.compensate
    def unhold(self) -> Event:
        return FxUnhold(hold_id=self.hold_id)

    @on_timer("remind")
    def remind(self) -> Event:
        return FxRemind(hold_id=self.hold_id)


SAGAS: dict[str, type[Saga]] = {
    "order": FxOrderSaga,
    "late": FxLateSaga,
    "timer": FxTimerSaga,
    "quick": FxQuickSaga,
    "heldreply": FxHeldReplySaga,
}

# -- participants ----------------------------------------------------------------------------

EFFECTS_TABLE = (
    "CREATE TABLE fx_effects (seq bigserial PRIMARY KEY, entity text NOT NULL, "
    "what text NOT NULL, message_id text NOT NULL, at timestamptz NOT NULL "
    "DEFAULT clock_timestamp())"
)
"""The participants' effects (no unique key on purpose: see the module docstring)."""


async def _effect(ctx: Context, entity: str, what: str) -> None:
    async with ctx.transaction() as tx:
        await tx.execute(
            "INSERT INTO fx_effects (entity, what, message_id) VALUES ($1, $2, $3)",
            entity,
            what,
            ctx.envelope.id,
        )


class ShippingGate:
    """Holds shipping back: ``arrived`` is set when a ship command came, and the participant
    answers it once ``opened`` is set; ``published`` has, per order, when its reply's publish
    returned (the broker had stored it), on the wall clock (UTC)."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.opened = asyncio.Event()
        self.published: dict[str, datetime] = {}


def participants(gate: ShippingGate | None = None) -> list[Any]:
    """Inventory, payment, shipping (order and quick sagas) and the holder (timer saga)."""

    @subscribe(FxReserve.event_type, group="fx.inventory", concurrency=8)
    async def reserve(cmd: FxReserve, ctx: Context) -> None:
        if cmd.order_id.endswith("-rejected"):
            await ctx.publish(FxNoStock(order_id=cmd.order_id))
            return
        await _effect(ctx, cmd.order_id, "reserved")
        await ctx.publish(FxReserved(order_id=cmd.order_id))

    @subscribe(FxRelease.event_type, group="fx.inventory", concurrency=8)
    async def release(cmd: FxRelease, ctx: Context) -> None:
        await _effect(ctx, cmd.order_id, "released")

    @subscribe(FxCharge.event_type, group="fx.payment", concurrency=8)
    async def charge(cmd: FxCharge, ctx: Context) -> None:
        if cmd.order_id.endswith("-declined"):
            await ctx.publish(FxDeclined(order_id=cmd.order_id))
            return
        await _effect(ctx, cmd.order_id, "charged")
        await ctx.publish(FxCharged(order_id=cmd.order_id, charge_id=f"ch-{cmd.order_id}"))

    @subscribe(FxRefund.event_type, group="fx.payment", concurrency=8)
    async def refund(cmd: FxRefund, ctx: Context) -> None:
        await _effect(ctx, cmd.order_id, "refunded")
        await ctx.publish(FxRefunded(order_id=cmd.order_id))

    @subscribe(FxShip.event_type, group="fx.shipping", concurrency=8)
    async def ship(cmd: FxShip, ctx: Context) -> None:
        if cmd.order_id.endswith("-late"):
            return  # never answers: the saga's ship step times out
        if gate is not None:
            gate.arrived.set()
            await gate.opened.wait()
        await _effect(ctx, cmd.order_id, "shipped")
        await ctx.publish(FxShipped(order_id=cmd.order_id))
        if gate is not None:
            gate.published[cmd.order_id] = datetime.now(UTC)

    @subscribe(FxHold.event_type, group="fx.holder", concurrency=8)
    async def hold(cmd: FxHold, ctx: Context) -> None:
        """Takes the hold and never answers: the step times out. Its group has handled the
        command, so the compensation undoes it (one it had not handled would be cancelled
        instead, and ``unhold`` not called)."""

    @subscribe(FxRemind.event_type, group="fx.holder", concurrency=8)
    async def remind(msg: FxRemind, ctx: Context) -> None:
        await _effect(ctx, msg.hold_id, "reminded")

    @subscribe(FxUnhold.event_type, group="fx.holder", concurrency=8)
    async def unhold(cmd: FxUnhold, ctx: Context) -> None:
        await _effect(ctx, cmd.hold_id, "unheld")

    return [reserve, release, charge, refund, ship, hold, remind, unhold]


# -- for the tests: the saga process from outside, and reading the stores -------------------


def nats_saga_url(nats_base: str, prefix: str, ack_wait: float = 1.0) -> str:
    """A NATS URL on a stream of the test's own, with short claims and acks (a killed
    member's partitions and unacked messages pass on within about 2 s at the default
    ``ack_wait``: ``lease_ttl`` defaults to ``ack_wait + ack_wait/3 + pull_expires + 0.5``)."""
    stream = unique_name(prefix).upper()
    return (
        f"{nats_base}?stream={stream}&ack_wait={ack_wait:g}&pull_expires=0.25"
        "&heartbeat_interval=0.25&partitions=4"
    )


@asynccontextmanager
async def saga_schema(lease_ttl: float) -> AsyncIterator[str]:
    """A PostgreSQL schema of its own for the saga processes, with a short lease TTL."""
    async with isolated_schema(postgres_url()) as url:
        yield f"{url}&lease_ttl={lease_ttl}"


@asynccontextmanager
async def effects_schema() -> AsyncIterator[str]:
    """A PostgreSQL schema of its own for the participants, with their effects table."""
    async with isolated_schema(postgres_url()) as url:
        conn = await connect(url)
        try:
            await conn.execute(EFFECTS_TABLE)
        finally:
            await conn.close()
        yield url


async def connect(store_url: str) -> asyncpg.Connection:
    """A plain connection on the schema of ``store_url``."""
    base, _, query = store_url.partition("?")
    schema = dict(p.split("=", 1) for p in query.split("&"))["schema"]
    return await asyncpg.connect(base, server_settings={"search_path": schema})


class SagaProcess(Child):
    """A ``saga_app.py`` process."""

    @classmethod
    async def start(cls, broker: str, store: str, saga: str) -> SagaProcess:
        """Start one and wait until its subscriptions are live."""
        return cls(await launch(__file__, broker, store, saga, what="the saga process"))


async def transitions(conn: asyncpg.Connection) -> int:
    """Saga transitions stored so far."""
    return int(await conn.fetchval("SELECT count(*) FROM ef_events WHERE stream_id LIKE 'saga-%'"))


async def ended(conn: asyncpg.Connection, keys: list[str]) -> bool:
    """Whether every saga of ``keys`` is completed or compensated (the index)."""
    done = await conn.fetchval(
        "SELECT count(*) FROM ef_sagas WHERE key = ANY($1::text[]) "
        "AND status IN ('completed', 'compensated')",
        keys,
    )
    return int(done) == len(keys)


# -- the saga process ------------------------------------------------------------------------


async def main(broker: str, store: str, saga: str) -> None:
    """Run the saga app until SIGTERM (graceful) or death."""
    logging.basicConfig(level=os.environ.get("FX_LOG_LEVEL", "WARNING"))
    app = App(
        "fx-sagas",
        broker=broker,
        store=store,
        sagas=[SAGAS[s] for s in saga.split(",")],
        heartbeat_interval=0.2,  # the tests read the processes' counters from the heartbeats
    )
    await serve(app)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
