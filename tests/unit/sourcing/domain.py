"""Events and aggregates shared by the sourcing tests (types prefixed ``agg.``)."""

from __future__ import annotations

from eventflow import Event
from eventflow.sourcing import Aggregate, on


class ItemAdded(Event, type="agg.cart.item_added"):
    """An item was put in the cart."""

    sku: str
    qty: int


class ItemRemoved(Event, type="agg.cart.item_removed"):
    """An item was taken out of the cart."""

    sku: str


class CheckedOut(Event, type="agg.cart.checked_out"):
    """The cart was checked out."""


class Noted(Event, type="agg.cart.noted"):
    """A note with no effect on any cart's state (no applier anywhere)."""

    text: str


class Cart(Aggregate, stream="cart"):
    """A shopping cart."""

    items: dict[str, int] = {}
    checked_out: bool = False

    def add(self, sku: str, qty: int) -> None:
        """A command: refuse after checkout, else record."""
        if self.checked_out:
            raise ValueError("cart is checked out")
        self.record(ItemAdded(sku=sku, qty=qty))

    @on(ItemAdded)
    def _added(self, e: ItemAdded) -> None:
        self.items[e.sku] = self.items.get(e.sku, 0) + e.qty

    @on(ItemRemoved)
    def _removed(self, e: ItemRemoved) -> None:
        self.items.pop(e.sku, None)

    @on(CheckedOut)
    def _checked_out(self, e: CheckedOut) -> None:
        self.checked_out = True
