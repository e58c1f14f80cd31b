"""The shop's events: the contract between the orders and inventory services.

Event types are logical names plus a version, never Python import paths, so either service
can be rewritten or moved without breaking the other.
"""

from __future__ import annotations

from eventflow import Event


class OrderPlaced(Event, type="shop.order.placed"):
    order_id: str
    sku: str
    qty: int


class StockReserved(Event, type="shop.stock.reserved"):
    order_id: str
    sku: str
    qty: int


class StockRejected(Event, type="shop.stock.rejected"):
    order_id: str
    sku: str
    requested: int
    in_stock: int
