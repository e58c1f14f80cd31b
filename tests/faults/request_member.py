"""The participant of the request-reply process test, in its own process.

    PYTHONPATH=.:tests python tests/faults/request_member.py BROKER_URL GROUP

Handles ``reqproc.stock.reserve`` in ``GROUP`` and answers with an ordinary ``ctx.publish``:
``StockRejected`` for more than 5, nothing for the sku ``silent``, and otherwise
``StockReserved`` after ``delay`` seconds (a slow participant, for late replies). Prints
``ready`` once its subscription is live, then ``got ORDER`` for each command; SIGTERM
stops it gracefully.
"""

from __future__ import annotations

import asyncio
import os
import sys

from eventflow import App, Context, Event, subscribe
from faults.children import serve


class ReserveStock(Event, type="reqproc.stock.reserve"):
    order_id: str
    sku: str = "sku-1"
    qty: int = 1
    delay: float = 0.0


class StockReserved(Event, type="reqproc.stock.reserved"):
    order_id: str
    pid: int


class StockRejected(Event, type="reqproc.stock.rejected"):
    order_id: str


def handlers(group: str) -> list[object]:
    """The inventory's handler in ``group``."""

    @subscribe(ReserveStock.event_type, group=group, concurrency=8)
    async def reserve(cmd: ReserveStock, ctx: Context) -> None:
        print(f"got {cmd.order_id}", flush=True)
        if cmd.sku == "silent":
            return
        if cmd.qty > 5:
            await ctx.publish(StockRejected(order_id=cmd.order_id))
            return
        await asyncio.sleep(cmd.delay)
        await ctx.publish(StockReserved(order_id=cmd.order_id, pid=os.getpid()))

    return [reserve]


if __name__ == "__main__":
    broker, group = sys.argv[1:3]
    asyncio.run(serve(App("inventory", broker=broker, handlers=handlers(group))))
