"""Sagas, participants and helpers for the tests of DESIGN section 5's promises (issue 20).

The order saga (inputs in any order, an abort in flight) and the trip sagas (a pivot, then
a step that backs off: a deploy, a late success) are here; the sagas with deadlines and
timers in :mod:`.promises_timed`. Event types are ``promise.*`` (no other test module uses
them). Participants record every
handler call in a :class:`Ledger` (``(what, order_id)``, in the order the handlers saw
them), so a test can count what each order reserved, charged and shipped, and see in which
order a participant saw a command and its compensation.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from eventflow import App, Context, Event, Saga, step, subscribe

from .conftest import SETUPS

Wait = Callable[..., Awaitable[None]]
ENDED = ("completed", "compensated", "failed")
BROKERS = [p for p in SETUPS if p.id in ("memory-memory", "nats-postgres", "kafka-postgres")]
"""Where the broker matters: memory, NATS + PostgreSQL, Kafka (Tansu) + PostgreSQL."""
STORES = [p for p in SETUPS if p.id in ("memory-memory", "memory-sqlite", "nats-postgres")]
"""Where the store matters: memory, SQLite, PostgreSQL."""
ENDS = 60.0
"""Seconds a saga of these tests may take to end (bounded polls)."""


@dataclass
class Ledger:
    """Every participant handler call, in the order they were made."""

    log: list[tuple[str, str]] = field(default_factory=list)

    def add(self, what: str, order_id: str) -> None:
        self.log.append((what, order_id))

    def of(self, order_id: str) -> list[str]:
        """What the participants did for one order, in order."""
        return [what for what, oid in self.log if oid == order_id]

    def count(self, what: str, order_id: str) -> int:
        return sum(1 for w, oid in self.log if w == what and oid == order_id)

    def counts(self, what: str) -> Counter[str]:
        """How many times each order got ``what``."""
        return Counter(oid for w, oid in self.log if w == what)


async def until_ended(app: App, cls: type[Saga], key: str, waiter: Wait, timeout: float) -> Any:
    """Wait (bounded) until the saga of ``key`` is completed, compensated or failed; return
    it. The failure message shows its status and history; a failed app fails it at once."""
    seen: list[Any] = [None]

    async def check() -> bool:
        seen[0] = await app.sagas.get(cls, key)
        if app.failure is not None:
            raise AssertionError(f"the app failed ({app.failure}); {key}: {describe(seen[0])}")
        return seen[0] is not None and seen[0].status in ENDED

    try:
        await waiter(check, timeout=timeout, what=f"{cls.__name__} {key} to end")
    except pytest.fail.Exception:
        pytest.fail(f"{cls.__name__} {key} did not end within {timeout}s: {describe(seen[0])}")
    return seen[0]


async def poll(
    condition: Callable[[], Awaitable[bool]], *, timeout: float, what: str, every: float = 0.2
) -> None:
    """Ask ``condition`` every ``every`` seconds until it is true; fail after ``timeout``
    (for conditions that read many sagas: the ``waiter`` fixture asks every 5 ms)."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)


def describe(saga: Any) -> str:
    """A saga's status, reason and history, for a failure message."""
    if saga is None:
        return "no saga"
    steps = [(t.kind, t.step, t.detail) for t in saga.history]
    return f"{saga.status} ({saga.reason}): {steps}"


def kinds(saga: Any, step_name: str | None = None) -> list[str]:
    """The transition kinds of a saga (of one step)."""
    return [t.kind for t in saga.history if step_name is None or t.step == step_name]


# -- the order saga: reserve, charge, ship; an abort event -----------------------------------


class OrderPlaced(Event, type="promise.order.placed"):
    order_id: str


class OrderCancelled(Event, type="promise.order.cancelled"):
    order_id: str


class ReserveStock(Event, type="promise.stock.reserve"):
    order_id: str


class StockReserved(Event, type="promise.stock.reserved"):
    order_id: str


class StockRejected(Event, type="promise.stock.rejected"):
    order_id: str


class ReleaseStock(Event, type="promise.stock.release"):
    order_id: str


class ChargePayment(Event, type="promise.payment.charge"):
    order_id: str


class PaymentCharged(Event, type="promise.payment.charged"):
    order_id: str


class RefundPayment(Event, type="promise.payment.refund"):
    order_id: str


class ShipOrder(Event, type="promise.shipping.ship"):
    order_id: str


class OrderShipped(Event, type="promise.shipping.shipped"):
    order_id: str


STEP_TIMEOUT = 120.0
"""The order saga's deadlines: none is reached in these tests (nothing may time out)."""


class PromiseOrderSaga(
    Saga, name="promise.order", start=OrderPlaced, key="order_id", abort=OrderCancelled
):
    """Reserve stock, charge, ship; cancelled by ``OrderCancelled`` before the charge."""

    order_id: str = ""

    def started(self, e: OrderPlaced) -> None:
        self.order_id = e.order_id

    @step(reply=StockReserved, reject=StockRejected, timeout=STEP_TIMEOUT)
    def reserve(self) -> Event:
        return ReserveStock(order_id=self.order_id)

    @reserve.compensate
    def release(self) -> Event:
        return ReleaseStock(order_id=self.order_id)

    @step(reply=PaymentCharged, timeout=STEP_TIMEOUT)
    def charge(self) -> Event:
        return ChargePayment(order_id=self.order_id)

    @charge.compensate
    def refund(self) -> Event:
        return RefundPayment(order_id=self.order_id)

    @step(reply=OrderShipped, timeout=STEP_TIMEOUT)
    def ship(self) -> Event:
        return ShipOrder(order_id=self.order_id)


@dataclass
class Shop:
    """How the order participants behave: ``silent_stock`` orders get no stock reply (the
    test answers for them); the stock handler waits for ``stock_open`` before each
    reservation, ``stock_concurrency`` at a time."""

    ledger: Ledger = field(default_factory=Ledger)
    silent_stock: set[str] = field(default_factory=set)
    stock_open: asyncio.Event = field(default_factory=asyncio.Event)
    stock_concurrency: int = 8
    stock_waiting: set[str] = field(default_factory=set)
    """Orders whose reserve command reached the stock handler, which waits to apply it."""

    def __post_init__(self) -> None:
        self.stock_open.set()

    def held_stock(self, order_id: str) -> int:
        """Stock the order holds after what the inventory saw, in the order it saw it: a
        release with nothing reserved releases nothing (so a release that overtook its
        reservation leaves the stock held)."""
        held = 0
        for what in self.ledger.of(order_id):
            if what == "reserved":
                held += 1
            elif what == "released" and held:
                held -= 1
        return held


def order_participants(shop: Shop, group: str) -> list[Any]:
    """Inventory, payment and shipping for :class:`PromiseOrderSaga` (groups ``<group>.*``)."""
    ledger = shop.ledger

    @subscribe(
        ReserveStock.event_type,
        group=f"{group}.inventory",
        concurrency=shop.stock_concurrency,
        timeout=120.0,
    )
    async def reserve(cmd: ReserveStock, ctx: Context) -> None:
        shop.stock_waiting.add(cmd.order_id)
        await shop.stock_open.wait()
        if cmd.order_id in shop.silent_stock:
            ledger.add("reserve-unanswered", cmd.order_id)
            return
        ledger.add("reserved", cmd.order_id)
        await ctx.publish(StockReserved(order_id=cmd.order_id))

    @subscribe(ReleaseStock.event_type, group=f"{group}.inventory", concurrency=8)
    async def release(cmd: ReleaseStock, ctx: Context) -> None:
        ledger.add("released", cmd.order_id)

    @subscribe(ChargePayment.event_type, group=f"{group}.payment", concurrency=8)
    async def charge(cmd: ChargePayment, ctx: Context) -> None:
        ledger.add("charged", cmd.order_id)
        await ctx.publish(PaymentCharged(order_id=cmd.order_id))

    @subscribe(RefundPayment.event_type, group=f"{group}.payment", concurrency=8)
    async def refund(cmd: RefundPayment, ctx: Context) -> None:
        ledger.add("refunded", cmd.order_id)

    @subscribe(ShipOrder.event_type, group=f"{group}.shipping", concurrency=8)
    async def ship(cmd: ShipOrder, ctx: Context) -> None:
        ledger.add("shipped", cmd.order_id)
        await ctx.publish(OrderShipped(order_id=cmd.order_id))

    return [reserve, release, charge, refund, ship]


# -- a pivot, then a forward step that backs off: the deploy and the late success -----------


class TripBooked(Event, type="promise.trip.booked"):
    order_id: str


class Verify(Event, type="promise.trip.verify"):
    order_id: str


class Verified(Event, type="promise.trip.verified"):
    order_id: str


class Charge(Event, type="promise.trip.charge"):
    order_id: str


class Charged(Event, type="promise.trip.charged"):
    order_id: str


class Deliver(Event, type="promise.trip.deliver"):
    order_id: str


class Delivered(Event, type="promise.trip.delivered"):
    order_id: str


class DeliveryFailed(Event, type="promise.trip.delivery-failed"):
    order_id: str


DEPLOY_BACKOFF = 5.0
"""Seconds the deploy sagas back off after a rejected delivery: the old app stops and the
new one starts within them."""


class TripSagaV1(Saga, name="promise.trip", start=TripBooked, key="order_id"):
    """Release 1: charge (the pivot), then deliver (rejected: sent again after a backoff)."""

    order_id: str = ""

    def started(self, e: TripBooked) -> None:
        self.order_id = e.order_id

    @step(reply=Charged, timeout=60.0, pivot=True)
    def charge(self) -> Event:
        return Charge(order_id=self.order_id)

    @step(reply=Delivered, reject=DeliveryFailed, timeout=60.0, retry=4, retry_delay=DEPLOY_BACKOFF)
    def deliver(self) -> Event:
        return Deliver(order_id=self.order_id)


class TripSagaV2(Saga, name="promise.trip", start=TripBooked, key="order_id"):
    """Release 2 of the same saga (same ``name=``): a verification step added in front."""

    order_id: str = ""

    def started(self, e: TripBooked) -> None:
        self.order_id = e.order_id

    @step(reply=Verified, timeout=60.0)
    def verify(self) -> Event:
        return Verify(order_id=self.order_id)

    @step(reply=Charged, timeout=60.0, pivot=True)
    def charge(self) -> Event:
        return Charge(order_id=self.order_id)

    @step(reply=Delivered, reject=DeliveryFailed, timeout=60.0, retry=4, retry_delay=DEPLOY_BACKOFF)
    def deliver(self) -> Event:
        return Deliver(order_id=self.order_id)


def trip_participants(ledger: Ledger, group: str, *, reject_first: int) -> list[Any]:
    """Verification, payment and delivery; delivery rejects the first ``reject_first``
    attempts of each order. Each handler call is in the ledger (``charged`` counts the
    payment's charges per order)."""
    deliveries: Counter[str] = Counter()

    @subscribe(Verify.event_type, group=f"{group}.verify", concurrency=8)
    async def verify(cmd: Verify, ctx: Context) -> None:
        ledger.add("verified", cmd.order_id)
        await ctx.publish(Verified(order_id=cmd.order_id))

    @subscribe(Charge.event_type, group=f"{group}.payment", concurrency=8)
    async def charge(cmd: Charge, ctx: Context) -> None:
        ledger.add("charged", cmd.order_id)
        await ctx.publish(Charged(order_id=cmd.order_id))

    @subscribe(Deliver.event_type, group=f"{group}.delivery", concurrency=8)
    async def deliver(cmd: Deliver, ctx: Context) -> None:
        deliveries[cmd.order_id] += 1
        if deliveries[cmd.order_id] <= reject_first:
            ledger.add("delivery-failed", cmd.order_id)
            await ctx.publish(DeliveryFailed(order_id=cmd.order_id))
            return
        ledger.add("delivered", cmd.order_id)
        await ctx.publish(Delivered(order_id=cmd.order_id))

    return [verify, charge, deliver]


LATE_DEADLINE = 1.0
"""Seconds the late-success saga waits for a delivery's answer."""
LATE_BACKOFF = 6.0
"""Seconds it backs off before sending the delivery again: the late answer comes within."""


class LateTripSaga(Saga, name="promise.latetrip", start=TripBooked, key="order_id"):
    """Charge (the pivot), then deliver with a short deadline and a long backoff."""

    order_id: str = ""

    def started(self, e: TripBooked) -> None:
        self.order_id = e.order_id

    @step(reply=Charged, timeout=60.0, pivot=True)
    def charge(self) -> Event:
        return Charge(order_id=self.order_id)

    @step(
        reply=Delivered,
        reject=DeliveryFailed,
        timeout=LATE_DEADLINE,
        retry=4,
        retry_delay=LATE_BACKOFF,
    )
    def deliver(self) -> Event:
        return Deliver(order_id=self.order_id)
