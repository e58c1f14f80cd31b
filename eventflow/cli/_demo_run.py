"""What ``eventflow demo`` does: plan a few hundred orders, place them through the shop's API
(``examples/shop``, all four services in this process), wait until each has ended, and
gather what the invariant checks need from the services' APIs and stores.

The input dictates each order's outcome: an amount above the payments limit is declined, a
line asking more than the stock on the shelf is rejected, an order cancelled right after it
was placed is compensated, every other one completes (the plan keeps the demand of those
within the stock available when the run starts, so that the outcome does not depend on
which order is handled first).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..ports import DeadLetter

__all__ = ["POISON", "DemoResult", "Planned", "plan", "run_demo"]

POISON = b"\x00\xff{this is not an envelope"
"""The poison message: garbage bytes published on the inventory's command topic."""

_NORMAL_SKUS = ("sku-1", "sku-2", "sku-3", "sku-5")
_POLL = 0.1


@dataclass
class Planned:
    """One order of the plan: its body, why it ends as it should, and how it is sent."""

    order_id: str
    body: dict[str, Any]
    kind: str  # "ok", "declined", "short" or "cancelled"
    duplicate: bool = False
    wait: bool = False
    placed: tuple[int, Any] | None = None  # what POST answered
    cancel: tuple[int, Any] | None = None  # what POST .../cancel answered

    @property
    def expected(self) -> str:
        """The final status its input dictates."""
        if self.kind == "cancelled" and self.cancel is not None and self.cancel[0] == 409:
            return "completed"  # the cancel came after the end: refused, the order stands
        return "completed" if self.kind == "ok" else "compensated"


@dataclass
class DemoResult:
    """What one run did and saw: the plan, the API's answers, the stores' contents."""

    store: str
    broker: str
    over_http: bool
    planned: list[Planned]
    final: dict[str, dict[str, Any]] = field(default_factory=dict)  # GET /orders, this run
    stock_before: dict[str, Any] = field(default_factory=dict)
    stock_after: dict[str, Any] = field(default_factory=dict)
    lowest_available: dict[str, int] = field(default_factory=dict)
    releases: Counter[tuple[str, str]] = field(default_factory=Counter)  # (order, sku)
    holds: Counter[tuple[str, str]] = field(default_factory=Counter)
    charges: list[dict[str, Any]] = field(default_factory=list)  # this run's provider rows
    shipments: Counter[str] = field(default_factory=Counter)
    late_shipments: int = 0
    compensations: Counter[str] = field(default_factory=Counter)  # step -> sent
    compensations_twice: list[str] = field(default_factory=list)
    aborts_ignored: set[str] = field(default_factory=set)  # cancelled after the pivot
    sagas: int = 0
    dead_letters: list[DeadLetter] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    trace_of: str | None = None
    trace: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    timed_out: bool = False


def plan(count: int, available: dict[str, int], decline_above: int, seed: int) -> list[Planned]:
    """``count`` orders with ids of this run, against the ``available`` stock per SKU."""
    from examples.shop.catalog import CATALOG

    rng = random.Random(seed)
    run = uuid.uuid4().hex[:6]
    budget = dict(available)
    out: list[Planned] = []
    for i in range(1, count + 1):
        order_id = f"demo-{run}-{i:04d}"
        roll = rng.random()
        lines: list[tuple[str, int]] | None = None
        if roll < 0.08:  # above the limit; it holds stock until it is released, so it counts
            kind, lines = "declined", _over_limit(budget, decline_above, CATALOG)
        elif roll >= 0.12:
            kind = "cancelled" if roll < 0.16 else "ok"
            lines = _normal_lines(rng, budget, decline_above, CATALOG)
        if lines is None:  # asked on purpose, or the shelf is empty: more than there is
            kind, lines = "short", [("sku-4", available.get("sku-4", 0) + 1), ("sku-1", 1)]
        if kind != "short":
            for sku, qty in lines:
                budget[sku] -= qty
        body = {
            "order_id": order_id,
            "customer": f"c-{rng.randint(1, 40)}",
            "lines": [{"sku": sku, "qty": qty} for sku, qty in lines],
        }
        out.append(Planned(order_id, body, kind, duplicate=i % 10 == 0, wait=i % 3 == 0))
    return out


def _over_limit(
    budget: dict[str, int], decline_above: int, catalog: Any
) -> list[tuple[str, int]] | None:
    for sku in ("sku-3", "sku-2", "sku-1"):
        qty = decline_above // catalog[sku].price_cents + 1
        if budget.get(sku, 0) >= qty:
            return [(sku, qty)]
    return None


def _normal_lines(
    rng: random.Random, budget: dict[str, int], decline_above: int, catalog: Any
) -> list[tuple[str, int]] | None:
    wanted: dict[str, int] = {}
    skus = [*_NORMAL_SKUS, "sku-4"] if rng.random() < 0.05 else list(_NORMAL_SKUS)
    for _ in range(rng.randint(1, 3)):
        sku = rng.choice(skus)
        qty = 1 if sku == "sku-4" else rng.randint(1, 3)
        total = sum(catalog[s].price_cents * q for s, q in wanted.items())
        if budget.get(sku, 0) - wanted.get(sku, 0) < qty:
            continue
        if total + catalog[sku].price_cents * qty > decline_above:
            continue
        wanted[sku] = wanted.get(sku, 0) + qty
    if not wanted:
        cheapest = "sku-5"
        if budget.get(cheapest, 0) < 1:
            return None
        wanted[cheapest] = 1
    return sorted(wanted.items())


async def run_demo(config: Any, count: int, *, seed: int = 7, timeout: float = 60.0) -> DemoResult:
    """Run the shop on ``config`` (an ``examples.shop.settings.Settings``), place ``count``
    orders through its API and gather the result."""
    from examples.shop import together

    started_at = datetime.now(UTC)
    async with together.running(config) as shop:
        client = shop.client
        _, before = await client.stock()
        available = {sku: row["on_hand"] - row["reserved"] for sku, row in before.items()}
        planned = plan(count, available, config.decline_above_cents, seed)
        result = DemoResult(config.store, config.broker, shop.over_http, planned)
        result.stock_before = before
        start = time.perf_counter()
        gate = asyncio.Semaphore(32)

        async def place(p: Planned) -> None:
            async with gate:
                p.placed = await client.place(p.body, wait=10.0 if p.wait else 0.0)
                if p.kind == "cancelled":  # right after it was placed
                    p.cancel = await client.cancel(p.order_id)
                if p.duplicate:  # a client that retried its POST
                    await client.place(p.body)

        tasks = [asyncio.ensure_future(place(p)) for p in planned]
        await asyncio.sleep(0)
        await shop.inventory.broker.publish("shop.stock.reserve", POISON)
        await asyncio.gather(*tasks)
        result.timed_out = not await _ended(client, planned, start + timeout)
        for app in (*shop.apps, *shop.apps):  # what the last replies caused, everywhere
            await app.wait_idle(timeout=max(1.0, start + timeout - time.perf_counter()))
        result.elapsed = time.perf_counter() - start
        ids = {p.order_id for p in planned}
        _, listed = await client.orders()
        result.final = {o["order_id"]: o for o in listed["orders"] if o["order_id"] in ids}
        _, result.stock_after = await client.stock()
        _, charges = await client.charges()
        result.charges = [c for c in charges["charges"] if c["order_id"] in ids]
        rows = await shop.orders.sagas.list(name="order", limit=1_000_000)
        result.sagas = sum(1 for row in rows if row.key in ids)
        await _read_stores(shop, ids, result)
        for app in shop.apps:
            letters = await app.dead_letters.list(limit=10_000)
            result.dead_letters += [d for d in letters if d.failed_at >= started_at]
            for counters in app.stats().values():
                for name, value in counters.items():
                    result.stats[name] = result.stats.get(name, 0) + value
        shown = _traced(planned, result.final)
        if shown is not None:
            _, body = await client.trace(shown)
            result.trace_of, result.trace = shown, list(body.get("tree", []))
    return result


async def _ended(client: Any, planned: list[Planned], deadline: float) -> bool:
    ids = {p.order_id for p in planned}
    while True:
        _, listed = await client.orders()
        ended = [o for o in listed["orders"] if o["order_id"] in ids and o["status"] != "pending"]
        if len(ended) >= len(ids):
            return True
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(_POLL)


async def _read_stores(shop: Any, ids: set[str], result: DemoResult) -> None:
    """Stock levels over the whole log (never negative), holds and releases per order,
    shipments, and the compensations each saga sent."""
    from examples.shop.events import (
        ShipmentDispatched,
        StockDeducted,
        StockFreed,
        StockHeld,
        StockSeeded,
    )

    on_hand: Counter[str] = Counter()
    reserved: Counter[str] = Counter()
    async for rec in shop.inventory.store.read_all():
        e = rec.event
        if isinstance(e, StockSeeded):
            on_hand[e.sku] += e.qty
        elif isinstance(e, StockHeld):
            reserved[e.sku] += e.qty
            if e.order_id in ids:
                result.holds[(e.order_id, e.sku)] += 1
        elif isinstance(e, StockFreed):
            reserved[e.sku] -= e.qty
            if e.order_id in ids:
                result.releases[(e.order_id, e.sku)] += 1
        elif isinstance(e, StockDeducted):
            reserved[e.sku] -= e.qty
            on_hand[e.sku] -= e.qty
        else:
            continue
        sku = e.sku
        low = min(on_hand[sku] - reserved[sku], on_hand[sku])
        result.lowest_available[sku] = min(result.lowest_available.get(sku, low), low)
    for order_id in ids:
        async for rec in shop.shipping.store.read_stream(f"shipment-{order_id}"):
            shipment = rec.event
            if isinstance(shipment, ShipmentDispatched):
                result.shipments[order_id] += 1
                result.late_shipments += shipment.late
    from examples.shop.orders import OrderSaga

    for order_id in ids:
        saga = await shop.orders.sagas.get(OrderSaga, order_id)
        if saga is None:
            continue
        if any(_late_abort(t.kind, t.detail) for t in saga.history):
            result.aborts_ignored.add(order_id)  # the cancel came after the pivot
        sent = Counter(t.step for t in saga.history if t.kind == "compensation-sent")
        sent.pop("accept", None)  # the notification of the end, not an undo
        result.compensations.update(sent)
        if any(n > 1 for n in sent.values()):
            result.compensations_twice.append(order_id)


def _late_abort(kind: str, detail: str) -> bool:
    """A transition that says an abort came once the saga was past its pivot."""
    return (
        kind == "ignored"
        and detail.startswith("abort (")
        and any(f" of a saga that is {status}:" in detail for status in ("running", "completed"))
    )


def _traced(planned: list[Planned], final: dict[str, dict[str, Any]]) -> str | None:
    """A compensated order to draw: a declined one (it was reserved, then released)."""
    for kind in ("declined", "cancelled", "short"):
        for p in planned:
            if p.kind == kind and final.get(p.order_id, {}).get("status") == "compensated":
                return p.order_id
    return None
