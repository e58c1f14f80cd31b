"""The shop's events and commands: the contract between its four services.

Event types are logical names plus a version (``shop.order.placed`` v2), never Python import
paths, so any service can be rewritten or moved without breaking the others. This module,
``settings.py`` and ``catalog.py`` are all the services share; `eventflow schema check
--module examples.shop.events --dir schemas` keeps the committed registry (``schemas/``) in
step with them.

Who sends what:

- orders appends ``OrderPlaced`` and ``OrderCancelled`` to the order's stream (the event
  relay publishes them); its saga sends ``ReserveStock``/``ReleaseStock`` (inventory),
  ``ChargePayment``/``RefundPayment`` (payments), ``ShipOrder`` (shipping) and, when it
  ends, ``OrderEnded``; ``WatchOrder``/``OrderSettled`` are its request-reply for
  ``POST /orders?wait=5``.
- inventory answers ``StockReserved``/``StockRejected`` and keeps ``StockSeeded``,
  ``StockHeld``, ``StockFreed`` and ``StockDeducted`` in the streams of its stock
  aggregates (``stock-<sku>``).
- payments answers ``PaymentCharged``/``PaymentDeclined``/``PaymentRefunded`` and keeps
  ``PaymentCaptured``/``PaymentReturned`` in ``payment-<order id>``.
- shipping answers ``OrderShipped`` and keeps ``ShipmentDispatched`` in
  ``shipment-<order id>``.

Money is in cents (``amount_cents``): integers add up exactly.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from eventflow import Event, upcaster

from .catalog import CATALOG

__all__ = [
    "OUTCOME_TOPIC",
    "ChargePayment",
    "Line",
    "OrderCancelled",
    "OrderEnded",
    "OrderPlaced",
    "OrderSettled",
    "OrderShipped",
    "PaymentCaptured",
    "PaymentCharged",
    "PaymentDeclined",
    "PaymentRefunded",
    "PaymentReturned",
    "RefundPayment",
    "ReleaseStock",
    "ReserveStock",
    "ShipOrder",
    "ShipmentDispatched",
    "StockDeducted",
    "StockFreed",
    "StockHeld",
    "StockRejected",
    "StockReserved",
    "StockSeeded",
    "WatchOrder",
]


class Line(BaseModel):
    """One line of an order: ``qty`` units of ``sku``."""

    sku: str
    qty: int = Field(ge=1)


# -- orders ------------------------------------------------------------------------------


class OrderPlaced(Event, type="shop.order.placed", version=2):
    """A customer placed an order (the start of the order saga)."""

    order_id: str
    customer: str
    lines: list[Line]
    amount_cents: int


@upcaster("shop.order.placed", from_version=1)
def _one_line_order(data: dict[str, Any]) -> dict[str, Any]:
    """v1 was one SKU per order and no customer (the first version of this example)."""
    item = CATALOG.get(data["sku"])
    price = item.price_cents if item is not None else 0
    return {
        "order_id": data["order_id"],
        "customer": "unknown",
        "lines": [{"sku": data["sku"], "qty": data["qty"]}],
        "amount_cents": price * data["qty"],
    }


class OrderCancelled(Event, type="shop.order.cancelled"):
    """The customer cancelled the order: it aborts the saga (before its pivot)."""

    order_id: str
    reason: str = "cancelled by the customer"


OUTCOME_TOPIC = "shop.order.ended"
"""The topic of ``OrderEnded``, where ``WatchOrder`` travels too: one topic and one key per
order, so a watch and its order's outcome are handled in the order they were sent."""


class OrderEnded(Event, type="shop.order.ended"):
    """The order saga ended (``completed`` or ``compensated``): its last command."""

    order_id: str
    status: str


class WatchOrder(Event, type="shop.order.watch"):
    """Tell me when this order ends (sent with ``app.request`` to ``OUTCOME_TOPIC``)."""

    order_id: str


class OrderSettled(Event, type="shop.order.settled"):
    """The reply to ``WatchOrder``: the order has ended with ``status``."""

    order_id: str
    status: str


# -- inventory ---------------------------------------------------------------------------


class ReserveStock(Event, type="shop.stock.reserve"):
    """Set the order's lines aside (all of them, or none)."""

    order_id: str
    lines: list[Line]


class StockReserved(Event, type="shop.stock.reserved", version=2):
    """Every line of the order is set aside."""

    order_id: str


@upcaster("shop.stock.reserved", from_version=1)
def _reserved_v1(data: dict[str, Any]) -> dict[str, Any]:
    return {"order_id": data["order_id"]}


class StockRejected(Event, type="shop.stock.rejected", version=2):
    """A line asked more than is available: nothing was set aside."""

    order_id: str
    reason: str


@upcaster("shop.stock.rejected", from_version=1)
def _rejected_v1(data: dict[str, Any]) -> dict[str, Any]:
    return {
        "order_id": data["order_id"],
        "reason": f"{data['requested']} x {data['sku']} asked, {data['in_stock']} left",
    }


class ReleaseStock(Event, type="shop.stock.release"):
    """Undo ``ReserveStock``: give back what the order holds (nothing held: nothing to do)."""

    order_id: str
    lines: list[Line]


class StockSeeded(Event, type="shop.stock.seeded"):
    """A SKU's stock, put on the shelf when inventory first starts."""

    sku: str
    qty: int


class StockHeld(Event, type="shop.stock.held"):
    """``qty`` units of ``sku`` set aside for an order."""

    sku: str
    order_id: str
    qty: int


class StockFreed(Event, type="shop.stock.freed"):
    """An order's units of ``sku`` are back on the shelf (its reservation released)."""

    sku: str
    order_id: str
    qty: int


class StockDeducted(Event, type="shop.stock.deducted"):
    """An order's units of ``sku`` left the warehouse (shipped): on hand goes down."""

    sku: str
    order_id: str
    qty: int


# -- payments ----------------------------------------------------------------------------


class ChargePayment(Event, type="shop.payment.charge"):
    """Charge the customer for the order (the saga's pivot)."""

    order_id: str
    amount_cents: int


class PaymentCharged(Event, type="shop.payment.charged"):
    """The provider took the money."""

    order_id: str
    charge_id: str


class PaymentDeclined(Event, type="shop.payment.declined"):
    """The charge was refused (over the limit): nothing was taken."""

    order_id: str
    reason: str


class RefundPayment(Event, type="shop.payment.refund"):
    """Undo ``ChargePayment``; ``charge_id`` is None when the charge timed out (refund by
    order id)."""

    order_id: str
    charge_id: str | None = None


class PaymentRefunded(Event, type="shop.payment.refunded"):
    """Whatever was charged for the order was given back (maybe nothing)."""

    order_id: str


class PaymentCaptured(Event, type="shop.payment.captured"):
    """Payments' record of a charge the provider made (stream ``payment-<order id>``)."""

    order_id: str
    charge_id: str
    amount_cents: int


class PaymentReturned(Event, type="shop.payment.returned"):
    """Payments' record of a refund (stream ``payment-<order id>``)."""

    order_id: str
    charge_id: str


# -- shipping ----------------------------------------------------------------------------


class ShipOrder(Event, type="shop.shipping.ship"):
    """Ship the order's lines to the customer (after the pivot: retried until it works)."""

    order_id: str
    customer: str
    lines: list[Line]


class OrderShipped(Event, type="shop.shipping.shipped"):
    """The order left the warehouse (one shipment per order, whatever the attempts)."""

    order_id: str
    shipment_id: str
    lines: list[Line]


class ShipmentDispatched(Event, type="shop.shipment.dispatched"):
    """Shipping's record of the shipment (stream ``shipment-<order id>``)."""

    order_id: str
    shipment_id: str
    lines: list[Line]
    late: bool
