"""The order saga and the watches of ``POST /orders?wait=5``: the orders service's part
that runs on messages (``orders.py`` has the API and wires both into the app).

``OrderSaga``: accept -> reserve (inventory) -> charge (payments, the pivot) -> ship
(shipping) -> close. ``track`` answers ``WatchOrder`` requests once their order ended.
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any

from eventflow import Context, Envelope, Event, Saga, step, subscribe

from .events import (
    OUTCOME_TOPIC,
    ChargePayment,
    Line,
    OrderCancelled,
    OrderEnded,
    OrderPlaced,
    OrderSettled,
    OrderShipped,
    PaymentCharged,
    PaymentDeclined,
    PaymentRefunded,
    RefundPayment,
    ReleaseStock,
    ReserveStock,
    ShipOrder,
    StockRejected,
    StockReserved,
    WatchOrder,
)
from .settings import settings

__all__ = ["FINAL", "WATCH_GROUP", "OrderSaga", "track"]

WATCH_GROUP = "shop-orders-watch"
FINAL = ("completed", "compensated")
_WATCHES = (
    "CREATE TABLE IF NOT EXISTS shop_order_watches "
    "(watch_id TEXT PRIMARY KEY, order_id TEXT NOT NULL, correlation_id TEXT NOT NULL)"
)
_SETTLED = uuid.UUID("0c6f4f55-5b3e-4a57-9d0e-4b1f2c3d4e5f")
_with_watches: weakref.WeakSet[Any] = weakref.WeakSet()  # the apps that made the table


async def _watch_table(app: Any) -> None:
    """Create ``shop_order_watches`` once per app, in a transaction of its own (not in
    every handling's transaction)."""
    if app not in _with_watches:
        async with app.store.transaction() as tx:
            await tx.execute(_WATCHES)
        _with_watches.add(app)


# -- the saga ---------------------------------------------------------------------------


class OrderSaga(
    Saga, name="order", start=OrderPlaced, key="order_id", abort=OrderCancelled, concurrency=16
):
    """reserve -> charge (the pivot) -> ship; ``accept`` and ``close`` announce the end
    (``OrderEnded``) to whoever waits for it."""

    order_id: str = ""
    customer: str = ""
    lines: list[Line] = []
    amount_cents: int = 0
    charge_id: str | None = None

    def started(self, e: OrderPlaced) -> None:
        self.order_id, self.customer = e.order_id, e.customer
        self.lines, self.amount_cents = list(e.lines), e.amount_cents

    @step()
    def accept(self) -> None:
        """A local step: nothing to send. Its compensation, the last to run, says the
        order is compensated."""
        return None

    @accept.compensate
    def _announce_compensated(self) -> Event:
        return OrderEnded(order_id=self.order_id, status="compensated")

    @step(reply=StockReserved, reject=StockRejected, timeout=settings.reserve_timeout)
    def reserve(self) -> ReserveStock:
        return ReserveStock(order_id=self.order_id, lines=self.lines)

    @reserve.compensate
    def release(self) -> ReleaseStock:
        return ReleaseStock(order_id=self.order_id, lines=self.lines)

    @step(
        reply=PaymentCharged,
        reject=PaymentDeclined,
        timeout=settings.charge_timeout,
        pivot=True,
    )
    def charge(self) -> ChargePayment:
        return ChargePayment(order_id=self.order_id, amount_cents=self.amount_cents)

    @charge.on_reply
    def _charged(self, e: PaymentCharged) -> None:
        self.charge_id = e.charge_id

    @charge.compensate(reply=PaymentRefunded, timeout=settings.refund_timeout)
    def refund(self) -> RefundPayment:
        # charge_id is None when the charge timed out: payments refunds by order id.
        return RefundPayment(order_id=self.order_id, charge_id=self.charge_id)

    @step(reply=OrderShipped, timeout=settings.ship_timeout, retry=8, retry_delay=0.25)
    def ship(self) -> ShipOrder:
        return ShipOrder(order_id=self.order_id, customer=self.customer, lines=self.lines)

    @step()
    def close(self) -> OrderEnded:
        return OrderEnded(order_id=self.order_id, status="completed")


# -- waiting for the end: request-reply --------------------------------------------------


@subscribe(OUTCOME_TOPIC, group=WATCH_GROUP, concurrency=16, retry=10, timeout=10.0, any_topic=True)
async def track(msg: WatchOrder | OrderEnded, ctx: Context) -> None:
    """Answer each ``WatchOrder`` with ``OrderSettled`` once its order ended: at once if
    it has, else when its ``OrderEnded`` comes. Both travel on ``OUTCOME_TOPIC`` with the
    order id as key, so they are handled in the order they were sent: an order that has
    not ended when its watch is handled sends its ``OrderEnded`` after the watch."""
    await _watch_table(ctx.app)
    async with ctx.transaction() as tx:
        if isinstance(msg, WatchOrder):
            saga = await ctx.app.sagas.get(OrderSaga, msg.order_id)  # type: ignore[attr-defined]
            if saga is not None and saga.status in FINAL:
                await ctx.publish(OrderSettled(order_id=msg.order_id, status=saga.status))
                return
            await tx.execute(
                "INSERT INTO shop_order_watches (watch_id, order_id, correlation_id) "
                "VALUES ($1, $2, $3) ON CONFLICT (watch_id) DO NOTHING",
                ctx.envelope.id,
                msg.order_id,
                ctx.envelope.correlation_id,
            )
            return
        rows = await tx.fetch(  # the watches of this order, taken: one statement
            "DELETE FROM shop_order_watches WHERE order_id = $1 RETURNING watch_id, correlation_id",
            msg.order_id,
        )
        for watch_id, correlation_id in rows:
            # The answer to that watch: caused by it, which is what app.request waits for.
            await ctx.publish(
                Envelope.create(
                    OrderSettled.event_type,
                    {"order_id": msg.order_id, "status": msg.status},
                    version=OrderSettled.event_version,
                    source=ctx.app.name,
                    id=str(uuid.uuid5(_SETTLED, watch_id)),
                    correlation_id=correlation_id,
                    causation_id=watch_id,
                    key=msg.order_id,
                )
            )
