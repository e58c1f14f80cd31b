"""The orders the multi-process shop tests place, and what each must end as.

The input alone dictates each outcome, whatever the timing: the orders that reserve stock
(those that complete and those the payment declines, which hold their stock until it is
released) never ask more of a SKU, all together, than its initial stock, so none of them
is ever short; a short order asks one more than the SKU's whole initial stock, so it is
always rejected; a declined order's amount is above the decline limit the test sets, and a
completed one's at or below it.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from decimal import Decimal

__all__ = ["Catalog", "Planned", "completed_units", "plan_orders"]


@dataclass(frozen=True)
class Catalog:
    """What the tests read of ``examples/shop/catalog.py``: stock and price per SKU."""

    stock: dict[str, int]
    price: dict[str, Decimal]

    @property
    def skus(self) -> list[str]:
        """The SKUs, in catalog order."""
        return list(self.stock)

    def amount(self, lines: list[tuple[str, int]]) -> Decimal:
        """sum(qty * price) of ``lines``."""
        return sum((self.price[sku] * qty for sku, qty in lines), Decimal(0))


@dataclass(frozen=True)
class Planned:
    """One order of the plan."""

    order_id: str
    lines: tuple[tuple[str, int], ...]
    kind: str  # "ok", "declined" or "short"

    @property
    def expected(self) -> str:
        """The final status the input dictates."""
        return "completed" if self.kind == "ok" else "compensated"

    def body(self) -> dict[str, object]:
        """The ``POST /orders`` body."""
        return {
            "order_id": self.order_id,
            "customer": f"c-{self.order_id}",
            "lines": [{"sku": sku, "qty": qty} for sku, qty in self.lines],
        }


def plan_orders(
    catalog: Catalog, *, count: int, declined: int, short: int, seed: int, prefix: str
) -> tuple[list[Planned], Decimal]:
    """``count`` orders, ``declined`` and ``short`` of them of those kinds, the rest to
    complete, shuffled; and the decline limit to set (``SHOP_DECLINE_ABOVE``).

    A completing order is one or two units of different SKUs, the dearest SKU left out, so
    the limit is the price of the next two dearest; a declined order asks, of one SKU with
    enough stock left, the fewest units that cost more than that."""
    rng = random.Random(seed)
    by_price = sorted(catalog.skus, key=lambda s: catalog.price[s], reverse=True)
    everyday = by_price[1:] if len(by_price) > 2 else by_price
    limit = catalog.amount([(sku, 1) for sku in everyday[:2]])
    left = dict(catalog.stock)
    kinds = ["declined"] * declined + ["short"] * short
    kinds += ["ok"] * (count - len(kinds))
    rng.shuffle(kinds)
    orders: list[Planned] = []
    for i, kind in enumerate(kinds):
        if kind == "declined":
            need = {sku: int(limit // catalog.price[sku]) + 1 for sku in catalog.skus}
            fits = [sku for sku in catalog.skus if left[sku] >= need[sku]]
            assert fits, f"no stock left for declined order {i}: place fewer orders"
            sku = max(fits, key=lambda s: left[s] / need[s])
            lines = [(sku, need[sku])]
        elif kind == "short":
            sku = rng.choice(catalog.skus)
            lines = [(sku, catalog.stock[sku] + 1)]
            other = [s for s in everyday if s != sku and left[s] > 0]
            if other and rng.random() < 0.5:  # a fine line beside the short one
                lines.insert(0, (rng.choice(other), 1))
        else:
            stocked = [s for s in everyday if left[s] > 0]
            assert stocked, f"no stock left for order {i}: place fewer orders"
            lines = [(s, 1) for s in rng.sample(stocked, k=min(rng.choice((1, 2)), len(stocked)))]
        orders.append(Planned(f"{prefix}-{i:03d}", tuple(lines), kind))
        for sku, qty in lines:
            if qty <= catalog.stock[sku]:  # a short line reserves nothing
                left[sku] -= qty
    for order in orders:  # the plan's own promise, checked before anything runs
        amount = catalog.amount(list(order.lines))
        if order.kind != "short":
            assert (amount > limit) == (order.kind == "declined"), (order, amount, limit)
    assert min(left.values()) >= 0, left
    return orders, limit


def completed_units(orders: list[Planned]) -> Counter[str]:
    """Units per SKU of the orders that complete."""
    units: Counter[str] = Counter()
    for order in orders:
        if order.kind == "ok":
            for sku, qty in order.lines:
                units[sku] += qty
    return units
