"""What the shop sells: SKUs, their unit prices (in cents) and the stock put on the shelf
when inventory first starts. A constant: the tests read it to check the end state."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATALOG", "Item", "amount_cents"]


@dataclass(frozen=True, slots=True)
class Item:
    """One SKU: its name, unit price in cents and initial stock."""

    sku: str
    name: str
    price_cents: int
    initial_stock: int


CATALOG: dict[str, Item] = {
    item.sku: item
    for item in (
        Item("sku-1", "tea towel", 1_250, 400),
        Item("sku-2", "teapot", 4_900, 200),
        Item("sku-3", "kettle", 12_000, 100),
        Item("sku-4", "espresso machine", 35_000, 20),
        Item("sku-5", "postcard", 500, 1_000),
    )
}


def amount_cents(lines: list[tuple[str, int]]) -> int:
    """The price of ``(sku, qty)`` lines, in cents."""
    return sum(CATALOG[sku].price_cents * qty for sku, qty in lines)
