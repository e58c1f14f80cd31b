"""The inventory service: answers every placed order with a reservation or a rejection.

Run it with ``eventflow run examples.shop.inventory:app`` (see README.md in this folder).
"""

from __future__ import annotations

import logging
import os

from eventflow import App, Context, subscribe

from .events import OrderPlaced, StockRejected, StockReserved

log = logging.getLogger("shop.inventory")

# Kept in memory to keep the example short; a real service keeps it in its database.
STOCK: dict[str, int] = {"sku-red": 25, "sku-green": 25, "sku-blue": 10}


@subscribe("shop.order.placed", group="inventory", concurrency=4, retry=5, timeout=10.0)
async def reserve(order: OrderPlaced, ctx: Context) -> None:
    """Take the units off the shelf if there are enough, and say so either way.

    Redelivered copies of an order never get here twice: the group's dedup store skips
    envelope ids it has already handled.
    """
    left = STOCK.get(order.sku, 0)
    if order.qty > left:
        log.info("order %s: only %d x %s left", order.order_id, left, order.sku)
        await ctx.publish(
            StockRejected(
                order_id=order.order_id, sku=order.sku, requested=order.qty, in_stock=left
            ),
            key=order.order_id,
        )
        return
    STOCK[order.sku] = left - order.qty
    log.info("order %s: reserved %d x %s", order.order_id, order.qty, order.sku)
    await ctx.publish(
        StockReserved(order_id=order.order_id, sku=order.sku, qty=order.qty), key=order.order_id
    )


app = App(
    "inventory",
    broker=os.environ.get("SHOP_BROKER", "memory://"),
    store=os.environ.get("SHOP_STORE", "sqlite:///shop.db"),
    handlers=[reserve],
)
