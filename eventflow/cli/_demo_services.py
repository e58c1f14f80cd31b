"""The demo's two services: an order service and an inventory service.

Their event types carry a ``demo.`` prefix so they never clash with an application's own.
Handlers are closures over a service object (``@subscribe`` only marks functions, so each
demo run builds fresh handlers over fresh state).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..context import Context
from ..events import Event
from ..subscribe import subscribe

__all__ = [
    "INVENTORY_GROUP",
    "ORDERS_GROUP",
    "InventoryService",
    "OrderPlaced",
    "OrderService",
    "StockRejected",
    "StockReserved",
    "WarehouseTimeout",
]

ORDERS_GROUP = "demo-orders"
INVENTORY_GROUP = "demo-inventory"


class OrderPlaced(Event, type="demo.order.placed"):
    """A customer placed an order for ``qty`` units of ``sku``."""

    order_id: str
    sku: str
    qty: int


class StockReserved(Event, type="demo.stock.reserved"):
    """The inventory set ``qty`` units of ``sku`` aside for the order."""

    order_id: str
    sku: str
    qty: int


class StockRejected(Event, type="demo.stock.rejected"):
    """Not enough stock: only ``available`` units of ``sku`` were left."""

    order_id: str
    sku: str
    qty: int
    available: int


class WarehouseTimeout(Exception):
    """A simulated transient failure; the retry policy recovers from it."""


@dataclass
class InventoryService:
    """Reserves stock for placed orders; ``flaky_every`` orders fail their first attempt."""

    stock: dict[str, int]
    flaky_every: int = 40
    initial: dict[str, int] = field(init=False)
    handled: Counter[str] = field(default_factory=Counter)
    reserved: int = 0
    reserved_units: int = 0
    rejected: int = 0
    lowest: int = field(init=False)

    def __post_init__(self) -> None:
        self.initial = dict(self.stock)
        self.lowest = min(self.stock.values(), default=0)

    def handlers(self) -> list[object]:
        """The service's ``@subscribe`` handlers, bound to this instance's state."""

        @subscribe("demo.order.placed", group=INVENTORY_GROUP, concurrency=8, retry=4, timeout=5.0)
        async def reserve_stock(event: OrderPlaced, ctx: Context) -> None:
            number = int(event.order_id.rsplit("-", 1)[-1])
            if self.flaky_every and number % self.flaky_every == 0 and ctx.attempt == 1:
                raise WarehouseTimeout(f"warehouse did not answer for {event.order_id}")
            # No await between the check and the update: other handlers cannot interleave.
            self.handled[event.order_id] += 1
            available = self.stock.get(event.sku, 0)
            if available >= event.qty:
                self.stock[event.sku] = available - event.qty
                self.lowest = min(self.lowest, self.stock[event.sku])
                self.reserved += 1
                self.reserved_units += event.qty
                reply: Event = StockReserved(order_id=event.order_id, sku=event.sku, qty=event.qty)
            else:
                self.rejected += 1
                reply = StockRejected(
                    order_id=event.order_id, sku=event.sku, qty=event.qty, available=available
                )
            await ctx.publish(reply, key=event.order_id)

        return [reserve_stock]


@dataclass
class OrderService:
    """Marks orders confirmed or rejected from the inventory's answers."""

    outcomes: dict[str, list[str]] = field(default_factory=dict)

    def handlers(self) -> list[object]:
        """The service's ``@subscribe`` handlers, bound to this instance's state."""

        @subscribe("demo.stock.*", group=ORDERS_GROUP, concurrency=4)
        async def settle_order(event: StockReserved | StockRejected, ctx: Context) -> None:
            status = "confirmed" if isinstance(event, StockReserved) else "rejected"
            self.outcomes.setdefault(event.order_id, []).append(status)

        return [settle_order]

    def count(self, status: str) -> int:
        """How many orders ended with ``status`` (their first outcome)."""
        return sum(1 for v in self.outcomes.values() if v and v[0] == status)
