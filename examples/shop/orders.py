"""The orders service: places orders and settles them from the inventory's answers.

Run it with ``eventflow run examples.shop.orders:app`` (see README.md in this folder).
"""

from __future__ import annotations

import asyncio
import logging
import os

from eventflow import App, Context, subscribe

from .events import OrderPlaced, StockRejected, StockReserved

log = logging.getLogger("shop.orders")

# order id -> "pending" | "confirmed" | "rejected" (in memory to keep the example short)
ORDERS: dict[str, str] = {}
_pending: set[str] = set()
_none_pending = asyncio.Event()


@subscribe("shop.stock.*", group="orders")
async def settle(answer: StockReserved | StockRejected, ctx: Context) -> None:
    """Confirm the order when its stock is reserved, reject it otherwise."""
    status = "confirmed" if isinstance(answer, StockReserved) else "rejected"
    ORDERS[answer.order_id] = status
    _pending.discard(answer.order_id)
    if not _pending:
        _none_pending.set()
    log.info("order %s %s (correlation %s)", answer.order_id, status, ctx.envelope.correlation_id)


app = App(
    "orders",
    broker=os.environ.get("SHOP_BROKER", "memory://"),
    store=os.environ.get("SHOP_STORE", "sqlite:///shop.db"),
    handlers=[settle],
)


async def place_order(order_id: str, sku: str, qty: int) -> None:
    """Publish an order; the key keeps every message about one order in order."""
    ORDERS[order_id] = "pending"
    _pending.add(order_id)
    _none_pending.clear()
    await app.publish(OrderPlaced(order_id=order_id, sku=sku, qty=qty), key=order_id)


async def wait_settled(timeout: float = 30.0) -> None:
    """Wait until no order is pending any more."""
    if _pending:
        await asyncio.wait_for(_none_pending.wait(), timeout)
