"""The order saga of DESIGN section 5 and scriptable participants, shared by the saga tests.

Participants answer through ``ctx.publish`` and record each effect in ``Effects`` (a
test's own instance, passed to ``participants``), so a test can check every effect happened
once and compensations came newest first. ``Script`` says how each participant answers
an order: reserve ok/reject, charge ok/decline, ship ok/never.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eventflow import Context, Event, Saga, step, subscribe


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
