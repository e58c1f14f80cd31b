"""The order saga of DESIGN section 5 and scriptable participants, shared by the saga tests.

Participants answer through ``ctx.publish`` and record each effect in ``Effects`` (a
test's own instance, passed to ``participants``), so a test can check every effect happened
once and compensations came newest first. ``Script`` says how each participant answers
an order: reserve ok/reject, charge ok/decline, ship ok/never.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eventflow import Context, Event, Saga, on_timer, step, subscribe


class OrderPlaced(Event, type="sagatest.order.placed"):
    order_id: str
    sku: str = "sku-1"
    qty: int = 1
    amount: int = 100


class OrderCancelled(Event, type="sagatest.order.cancelled"):
    order_id: str


class ReserveStock(Event, type="sagatest.stock.reserve"):
    order_id: str
    sku: str
    qty: int


class StockReserved(Event, type="sagatest.stock.reserved"):
    order_id: str


class StockRejected(Event, type="sagatest.stock.rejected"):
    order_id: str


class ReleaseStock(Event, type="sagatest.stock.release"):
    order_id: str


class ChargePayment(Event, type="sagatest.payment.charge"):
    order_id: str
    amount: int


class PaymentCharged(Event, type="sagatest.payment.charged"):
    order_id: str
    charge_id: str


class PaymentDeclined(Event, type="sagatest.payment.declined"):
    order_id: str


class RefundPayment(Event, type="sagatest.payment.refund"):
    order_id: str
    charge_id: str | None


class PaymentRefunded(Event, type="sagatest.payment.refunded"):
    order_id: str


class ShipOrder(Event, type="sagatest.shipping.ship"):
    order_id: str


class OrderShipped(Event, type="sagatest.shipping.shipped"):
    order_id: str


class OrderSaga(
    Saga, name="sagatest.order", start=OrderPlaced, key="order_id", abort=OrderCancelled
):
    """Reserve stock, charge the payment, ship."""

    order_id: str = ""
    sku: str = ""
    qty: int = 0
    amount: int = 0
    charge_id: str | None = None

    def started(self, e: OrderPlaced) -> None:
        self.order_id, self.sku, self.qty, self.amount = e.order_id, e.sku, e.qty, e.amount

    @step(reply=StockReserved, reject=StockRejected, timeout=30.0)
    def reserve(self) -> Event:
        return ReserveStock(order_id=self.order_id, sku=self.sku, qty=self.qty)

    @reserve.compensate
    def release(self) -> Event:
        return ReleaseStock(order_id=self.order_id)

    @step(reply=PaymentCharged, reject=PaymentDeclined, timeout=30.0)
    def charge(self) -> Event:
        return ChargePayment(order_id=self.order_id, amount=self.amount)

    @charge.on_reply
    def _charged(self, e: PaymentCharged) -> None:
        self.charge_id = e.charge_id

    @charge.compensate
    def refund(self) -> Event:
        return RefundPayment(order_id=self.order_id, charge_id=self.charge_id)

    @step(reply=OrderShipped, timeout=1.0)
    def ship(self) -> Event:
        return ShipOrder(order_id=self.order_id)


@dataclass
class Script:
    """How participants answer, per order id (default: everything succeeds)."""

    reject_stock: set[str] = field(default_factory=set)
    decline: set[str] = field(default_factory=set)
    never_ship: set[str] = field(default_factory=set)


@dataclass
class Effects:
    """Every participant effect, in the order applied."""

    log: list[tuple[str, str]] = field(default_factory=list)

    def of(self, order_id: str) -> list[str]:
        return [what for what, oid in self.log if oid == order_id]


def participants(script: Script, effects: Effects, group: str = "shop") -> list[Any]:
    """The inventory, payment and shipping handlers."""

    @subscribe(ReserveStock.event_type, group=f"{group}.inventory")
    async def reserve(cmd: ReserveStock, ctx: Context) -> None:
        if cmd.order_id in script.reject_stock:
            await ctx.publish(StockRejected(order_id=cmd.order_id))
            return
        effects.log.append(("reserved", cmd.order_id))
        await ctx.publish(StockReserved(order_id=cmd.order_id))

    @subscribe(ReleaseStock.event_type, group=f"{group}.inventory")
    async def release(cmd: ReleaseStock, ctx: Context) -> None:
        effects.log.append(("released", cmd.order_id))

    @subscribe(ChargePayment.event_type, group=f"{group}.payment")
    async def charge(cmd: ChargePayment, ctx: Context) -> None:
        if cmd.order_id in script.decline:
            await ctx.publish(PaymentDeclined(order_id=cmd.order_id))
            return
        effects.log.append(("charged", cmd.order_id))
        await ctx.publish(PaymentCharged(order_id=cmd.order_id, charge_id=f"ch-{cmd.order_id}"))

    @subscribe(RefundPayment.event_type, group=f"{group}.payment")
    async def refund(cmd: RefundPayment, ctx: Context) -> None:
        effects.log.append(("refunded", cmd.order_id))

    @subscribe(ShipOrder.event_type, group=f"{group}.shipping")
    async def ship(cmd: ShipOrder, ctx: Context) -> None:
        if cmd.order_id in script.never_ship:
            return
        effects.log.append(("shipped", cmd.order_id))
        await ctx.publish(OrderShipped(order_id=cmd.order_id))

    return [reserve, release, charge, refund, ship]


Check = Callable[[], bool]


# -- more sagas for the broker and outage tests (issue 14, "Must show") --------------------


SHIP_DEADLINE = 8.0
"""Seconds ``OutageSaga`` waits for ``OrderShipped``: enough for the outage test's reply to
be seen on the broker before it, behind the backlog of 100 in its lane, under the full
suite's load (5 s was not, once, on Kafka + PostgreSQL)."""


class OutageSaga(
    Saga, name="sagatest.outage", start=OrderPlaced, key="order_id", abort=OrderCancelled
):
    """The order saga with a longer shipping deadline (``SHIP_DEADLINE``), so a test can stop
    the saga's app, let the participant reply and wait past the deadline in between."""

    order_id: str = ""
    sku: str = ""
    qty: int = 0
    amount: int = 0
    charge_id: str | None = None

    def started(self, e: OrderPlaced) -> None:
        self.order_id, self.sku, self.qty, self.amount = e.order_id, e.sku, e.qty, e.amount

    @step(reply=StockReserved, reject=StockRejected, timeout=30.0)
    def reserve(self) -> Event:
        return ReserveStock(order_id=self.order_id, sku=self.sku, qty=self.qty)

    @reserve.compensate
    def release(self) -> Event:
        return ReleaseStock(order_id=self.order_id)

    @step(reply=PaymentCharged, reject=PaymentDeclined, timeout=30.0)
    def charge(self) -> Event:
        return ChargePayment(order_id=self.order_id, amount=self.amount)

    @charge.on_reply
    def _charged(self, e: PaymentCharged) -> None:
        self.charge_id = e.charge_id

    @charge.compensate
    def refund(self) -> Event:
        return RefundPayment(order_id=self.order_id, charge_id=self.charge_id)

    @step(reply=OrderShipped, timeout=SHIP_DEADLINE)
    def ship(self) -> Event:
        return ShipOrder(order_id=self.order_id)


@dataclass
class Gate:
    """Holds the shipping participant's reply for the orders in ``held`` until ``opened``;
    orders in ``silent`` get no reply at all. ``replied_at`` is when each reply was seen on
    the broker (by an observer group), ``arrived`` the orders whose command arrived."""

    held: set[str] = field(default_factory=set)
    silent: set[str] = field(default_factory=set)
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: set[str] = field(default_factory=set)
    replied_at: dict[str, float] = field(default_factory=dict)


def gated_shipping(gate: Gate, effects: Effects, group: str = "shop") -> list[Any]:
    """A shipping handler for ``gate.held`` and ``gate.silent`` (give those orders to the
    plain participants' ``Script.never_ship``) and an observer of ``OrderShipped``."""

    @subscribe(ShipOrder.event_type, group=f"{group}.gated", concurrency=8, timeout=60.0)
    async def ship(cmd: ShipOrder, ctx: Context) -> None:
        if cmd.order_id in gate.silent:
            gate.arrived.add(cmd.order_id)
            return
        if cmd.order_id not in gate.held:
            return
        gate.arrived.add(cmd.order_id)
        await asyncio.wait_for(gate.opened.wait(), 50.0)
        effects.log.append(("shipped", cmd.order_id))
        await ctx.publish(OrderShipped(order_id=cmd.order_id))

    @subscribe(OrderShipped.event_type, group=f"{group}.observer")
    async def seen(reply: OrderShipped, ctx: Context) -> None:
        gate.replied_at.setdefault(reply.order_id, time.time())

    return [ship, seen]


class PivotStarted(Event, type="sagatest.pivot.started"):
    order_id: str


class HoldSeat(Event, type="sagatest.pivot.hold"):
    order_id: str


class SeatHeld(Event, type="sagatest.pivot.held"):
    order_id: str


class FreeSeat(Event, type="sagatest.pivot.free"):
    order_id: str


class Confirm(Event, type="sagatest.pivot.confirm"):
    order_id: str


class Confirmed(Event, type="sagatest.pivot.confirmed"):
    order_id: str


class Deliver(Event, type="sagatest.pivot.deliver"):
    order_id: str


class Delivered(Event, type="sagatest.pivot.delivered"):
    order_id: str


class DeliveryFailed(Event, type="sagatest.pivot.delivery-failed"):
    order_id: str


class PivotCancelled(Event, type="sagatest.pivot.cancelled"):
    order_id: str


class PivotSaga(
    Saga, name="sagatest.pivot", start=PivotStarted, key="order_id", abort=PivotCancelled
):
    """Hold a seat (compensable), confirm (the pivot), deliver (forward only: retried)."""

    order_id: str = ""

    def started(self, e: PivotStarted) -> None:
        self.order_id = e.order_id

    @step(reply=SeatHeld, timeout=30.0)
    def hold(self) -> Event:
        return HoldSeat(order_id=self.order_id)

    @hold.compensate
    def free(self) -> Event:
        return FreeSeat(order_id=self.order_id)

    @step(reply=Confirmed, timeout=30.0, pivot=True)
    def confirm(self) -> Event:
        return Confirm(order_id=self.order_id)

    @step(reply=Delivered, reject=DeliveryFailed, timeout=30.0, retry=4, retry_delay=0.05)
    def deliver(self) -> Event:
        return Deliver(order_id=self.order_id)


def pivot_participants(
    effects: Effects, fail_first: int, stall: frozenset[str] = frozenset(), group: str = "shop"
) -> list[Any]:
    """Seats, confirmation and delivery: delivery rejects the first ``fail_first`` attempts
    of each order; the orders in ``stall`` are never confirmed."""
    attempts: dict[str, int] = {}

    @subscribe(HoldSeat.event_type, group=f"{group}.seats")
    async def hold(cmd: HoldSeat, ctx: Context) -> None:
        effects.log.append(("held", cmd.order_id))
        await ctx.publish(SeatHeld(order_id=cmd.order_id))

    @subscribe(FreeSeat.event_type, group=f"{group}.seats")
    async def free(cmd: FreeSeat, ctx: Context) -> None:
        effects.log.append(("freed", cmd.order_id))

    @subscribe(Confirm.event_type, group=f"{group}.confirm")
    async def confirm(cmd: Confirm, ctx: Context) -> None:
        if cmd.order_id in stall:
            effects.log.append(("stalled", cmd.order_id))
            return
        effects.log.append(("confirmed", cmd.order_id))
        await ctx.publish(Confirmed(order_id=cmd.order_id))

    @subscribe(Deliver.event_type, group=f"{group}.delivery")
    async def deliver(cmd: Deliver, ctx: Context) -> None:
        n = attempts[cmd.order_id] = attempts.get(cmd.order_id, 0) + 1
        if n <= fail_first:
            effects.log.append(("delivery-failed", cmd.order_id))
            await ctx.publish(DeliveryFailed(order_id=cmd.order_id))
            return
        effects.log.append(("delivered", cmd.order_id))
        await ctx.publish(Delivered(order_id=cmd.order_id))

    return [hold, free, confirm, deliver]


class TimersStarted(Event, type="sagatest.timers.started"):
    order_id: str


class Ask(Event, type="sagatest.timers.ask"):
    order_id: str


class Answered(Event, type="sagatest.timers.answered"):
    order_id: str


class Await(Event, type="sagatest.timers.await"):
    order_id: str


class Remind(Event, type="sagatest.timers.remind"):
    order_id: str


class Done(Event, type="sagatest.timers.done"):
    order_id: str


REMINDER_FIRST = 30.0
REMINDER_AGAIN = 2.0
EXPIRY = 1.5


class TimerSaga(Saga, name="sagatest.timers", start=TimersStarted, key="order_id"):
    """Named timers: ``reminder`` set for ``REMINDER_FIRST`` s at the start and rescheduled
    to ``REMINDER_AGAIN`` s by the answer of ``ask``, which also cancels ``expire`` (set for
    ``EXPIRY`` s: it would abort the saga). The reminder's message gets ``Done``, which
    completes the last step."""

    order_id: str = ""

    def started(self, e: TimersStarted) -> None:
        self.order_id = e.order_id
        self.set_timer("reminder", REMINDER_FIRST)
        self.set_timer("expire", EXPIRY)

    @step(reply=Answered, timeout=30.0)
    def ask(self) -> Event:
        return Ask(order_id=self.order_id)

    @ask.on_reply
    def _answered(self, e: Answered) -> None:
        self.set_timer("reminder", REMINDER_AGAIN)
        self.cancel_timer("expire")

    @step(reply=Done, timeout=30.0)
    def wait(self) -> Event:
        return Await(order_id=self.order_id)

    @on_timer("reminder")
    def _remind(self) -> Event:
        return Remind(order_id=self.order_id)

    @on_timer("expire")
    def _expire(self) -> None:
        self.abort("expired")


def timer_participants(effects: Effects, group: str = "shop") -> list[Any]:
    """Answers ``Ask`` at once, ignores ``Await``, answers ``Remind`` with ``Done``."""

    @subscribe(Ask.event_type, group=f"{group}.ask")
    async def ask(cmd: Ask, ctx: Context) -> None:
        effects.log.append(("asked", cmd.order_id))
        await ctx.publish(Answered(order_id=cmd.order_id))

    @subscribe(Remind.event_type, group=f"{group}.remind")
    async def remind(msg: Remind, ctx: Context) -> None:
        effects.log.append(("reminded", msg.order_id))
        await ctx.publish(Done(order_id=msg.order_id))

    return [ask, remind]


class BookingStarted(Event, type="sagatest.booking.started"):
    order_id: str


class Book(Event, type="sagatest.booking.book"):
    order_id: str


class Booked(Event, type="sagatest.booking.booked"):
    order_id: str


class Unbook(Event, type="sagatest.booking.unbook"):
    order_id: str


class Unbooked(Event, type="sagatest.booking.unbooked"):
    order_id: str


class Pay(Event, type="sagatest.booking.pay"):
    order_id: str


class PayDeclined(Event, type="sagatest.booking.declined"):
    order_id: str


class Paid(Event, type="sagatest.booking.paid"):
    order_id: str


UNBOOK_TIMEOUT = 1.5


class BookingSaga(Saga, name="sagatest.booking", start=BookingStarted, key="order_id"):
    """Book (its compensation waits for ``Unbooked``, ``UNBOOK_TIMEOUT`` s), then pay."""

    order_id: str = ""

    def started(self, e: BookingStarted) -> None:
        self.order_id = e.order_id

    @step(reply=Booked, timeout=30.0)
    def book(self) -> Event:
        return Book(order_id=self.order_id)

    @book.compensate(reply=Unbooked, timeout=UNBOOK_TIMEOUT)
    def unbook(self) -> Event:
        return Unbook(order_id=self.order_id)

    @step(reply=Paid, reject=PayDeclined, timeout=30.0)
    def pay(self) -> Event:
        return Pay(order_id=self.order_id)


@dataclass
class Desk:
    """The booking participant's switch: answer ``Unbook`` only once ``answer`` is set."""

    answer: bool = False


def booking_participants(desk: Desk, effects: Effects, group: str = "shop") -> list[Any]:
    """Books, declines every payment, and undoes a booking (answering only when told)."""

    @subscribe(Book.event_type, group=f"{group}.booking")
    async def book(cmd: Book, ctx: Context) -> None:
        effects.log.append(("booked", cmd.order_id))
        await ctx.publish(Booked(order_id=cmd.order_id))

    @subscribe(Unbook.event_type, group=f"{group}.booking")
    async def unbook(cmd: Unbook, ctx: Context) -> None:
        if not desk.answer:
            effects.log.append(("unbook-unanswered", cmd.order_id))
            return
        effects.log.append(("unbooked", cmd.order_id))
        await ctx.publish(Unbooked(order_id=cmd.order_id))

    @subscribe(Pay.event_type, group=f"{group}.pay")
    async def pay(cmd: Pay, ctx: Context) -> None:
        effects.log.append(("declined", cmd.order_id))
        await ctx.publish(PayDeclined(order_id=cmd.order_id))

    return [book, unbook, pay]
