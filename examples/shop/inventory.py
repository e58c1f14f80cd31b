"""The inventory service: a stock aggregate per SKU, the ``stock_levels`` projection and
``GET /stock``.

    uvicorn examples.shop.inventory:http --port $SHOP_INVENTORY_PORT

- ``Stock`` (stream ``stock-<sku>``) holds what is on hand and what each order has set
  aside; it refuses a reservation larger than what is available, so available stock never
  goes below zero, whatever the number of inventory instances: a reservation locks its
  SKUs' rows in ``shop_stock_locks`` (in the handling's transaction, in SKU order), so two
  handlings of one SKU take turns instead of conflicting.
- The saga's ``ReserveStock`` and its compensation ``ReleaseStock`` are handled in one
  group (``shop-inventory``), with dedup on: a release that arrives before its reserve
  cancels it (the reserve is skipped when it comes; docs/sagas.md, "Participants").
- ``OrderShipped`` turns the order's reservation into a deduction (on hand goes down).
- Every change commits in ``ctx.transaction()`` with the dedup entry and the reply (inbox +
  outbox): each command is applied once.
- The stock is seeded from ``catalog.py`` on first start (idempotent; a SKU first touched
  by a command is seeded then, under the same lock).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from contextlib import asynccontextmanager
from typing import Any

from eventflow import (
    Aggregate,
    AggregateNotFound,
    App,
    ConcurrencyError,
    Context,
    Projection,
    ProjectionContext,
    Repository,
    Transaction,
    on,
    subscribe,
)

from .catalog import CATALOG
from .events import (
    Line,
    OrderShipped,
    ReleaseStock,
    ReserveStock,
    StockDeducted,
    StockFreed,
    StockHeld,
    StockRejected,
    StockReserved,
    StockSeeded,
)
from .settings import Settings, settings
from .web import service_http

try:  # the HTTP API (pip install 'eventflow[fastapi]'); the rest works without it
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
except ImportError:  # pragma: no cover - eventflow demo on the core dependencies
    FastAPI = None  # type: ignore[assignment,misc]

__all__ = [
    "GROUP",
    "Stock",
    "StockLevels",
    "create_app",
    "create_http",
    "seed",
    "stock_levels",
]

log = logging.getLogger("shop.inventory")

GROUP = "shop-inventory"
SNAPSHOT_EVERY = 20
_LOCKS = (
    "CREATE TABLE IF NOT EXISTS shop_stock_locks (sku TEXT PRIMARY KEY, turns INTEGER NOT NULL)"
)
# One statement takes a SKU's lock: it makes the row or bumps it, and either way holds the
# row's lock until the handling's transaction ends.
_TAKE_TURN = (
    "INSERT INTO shop_stock_locks (sku, turns) VALUES ($1, 1) "
    "ON CONFLICT (sku) DO UPDATE SET turns = shop_stock_locks.turns + 1"
)
_with_locks: weakref.WeakSet[Any] = weakref.WeakSet()  # the apps that made it


async def _lock_table(app: Any) -> None:
    """Create ``shop_stock_locks`` once per app, in a transaction of its own before the
    first handling uses it (not inside every handling's transaction). Handlings that
    start together before it exists each create it, as idempotently as before."""
    if app not in _with_locks:
        async with app.store.transaction() as tx:
            await tx.execute(_LOCKS)
        _with_locks.add(app)


class Stock(Aggregate, stream="stock"):
    """One SKU's stock: on hand, and the units each order has set aside."""

    sku: str = ""
    on_hand: int = 0
    held: dict[str, int] = {}  # order id -> units set aside

    @property
    def available(self) -> int:
        """What can still be reserved."""
        return self.on_hand - sum(self.held.values())

    def hold(self, order_id: str, qty: int) -> None:
        """Set ``qty`` units aside for the order (once; the caller checked ``available``)."""
        if order_id not in self.held:
            self.record(StockHeld(sku=self.sku, order_id=order_id, qty=qty))

    def free(self, order_id: str) -> None:
        """Give back what the order holds (nothing held: nothing to do)."""
        if order_id in self.held:
            self.record(StockFreed(sku=self.sku, order_id=order_id, qty=self.held[order_id]))

    def deduct(self, order_id: str) -> None:
        """The order shipped: its units leave the shelf (once)."""
        if order_id in self.held:
            self.record(StockDeducted(sku=self.sku, order_id=order_id, qty=self.held[order_id]))

    @on(StockSeeded)
    def _seeded(self, e: StockSeeded) -> None:
        self.sku, self.on_hand = e.sku, self.on_hand + e.qty

    @on(StockHeld)
    def _held(self, e: StockHeld) -> None:
        self.held[e.order_id] = e.qty

    @on(StockFreed)
    def _freed(self, e: StockFreed) -> None:
        self.held.pop(e.order_id, None)

    @on(StockDeducted)
    def _deducted(self, e: StockDeducted) -> None:
        self.held.pop(e.order_id, None)
        self.on_hand -= e.qty


class StockLevels(Projection, name="stock_levels"):
    """``stock_levels (sku, on_hand, reserved)``: what ``GET /stock`` shows."""

    async def setup(self, tx: Transaction) -> None:
        """Create the table (idempotent)."""
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS stock_levels "
            "(sku TEXT PRIMARY KEY, on_hand INTEGER NOT NULL, reserved INTEGER NOT NULL)"
        )

    async def reset(self, tx: Transaction) -> None:
        """Empty the table before a rebuild."""
        await tx.execute("DELETE FROM stock_levels")

    async def _add(self, ctx: ProjectionContext, sku: str, on_hand: int, reserved: int) -> None:
        await ctx.transaction().execute(
            "INSERT INTO stock_levels (sku, on_hand, reserved) VALUES ($1, $2, $3) "
            "ON CONFLICT (sku) DO UPDATE SET on_hand = stock_levels.on_hand + excluded.on_hand,"
            " reserved = stock_levels.reserved + excluded.reserved",
            sku,
            on_hand,
            reserved,
        )

    @on(StockSeeded)
    async def _seeded(self, e: StockSeeded, ctx: ProjectionContext) -> None:
        await self._add(ctx, e.sku, e.qty, 0)

    @on(StockHeld)
    async def _held(self, e: StockHeld, ctx: ProjectionContext) -> None:
        await self._add(ctx, e.sku, 0, e.qty)

    @on(StockFreed)
    async def _freed(self, e: StockFreed, ctx: ProjectionContext) -> None:
        await self._add(ctx, e.sku, 0, -e.qty)

    @on(StockDeducted)
    async def _deducted(self, e: StockDeducted, ctx: ProjectionContext) -> None:
        await self._add(ctx, e.sku, -e.qty, -e.qty)


def _repository(ctx: Context) -> Repository[Stock]:
    # ctx.store: appends made inside ctx.transaction() join it.
    return Repository(Stock, ctx.store, snapshot_every=SNAPSHOT_EVERY, source=ctx.app.name)


async def _stocks(ctx: Context, tx: Transaction, lines: list[Line]) -> dict[str, Stock]:
    """The aggregates of the lines' SKUs, each locked for this transaction (in SKU order,
    so two handlings never wait for each other in a circle), seeded on first use. The
    caller made the lock table (``_lock_table``) before opening ``tx``."""
    repo = _repository(ctx)
    stocks: dict[str, Stock] = {}
    for sku in sorted({line.sku for line in lines}):
        await tx.execute(_TAKE_TURN, sku)
        stocks[sku] = await _load_or_seed(repo, sku)
    return stocks


async def _load_or_seed(repo: Repository[Stock], sku: str) -> Stock:
    try:
        return await repo.load(sku)
    except AggregateNotFound:
        stock = Stock(id=sku)
        item = CATALOG.get(sku)
        stock.record(StockSeeded(sku=sku, qty=item.initial_stock if item else 0))
        return stock


async def _save(ctx: Context, stocks: dict[str, Stock]) -> None:
    repo = _repository(ctx)
    for stock in stocks.values():
        await repo.save(stock, caused_by=ctx.envelope)


@subscribe("shop.stock.reserve", group=GROUP, concurrency=8, retry=10, timeout=10.0)
async def reserve(cmd: ReserveStock, ctx: Context) -> None:
    """Set every line aside, or none: a line asking more than is available rejects all."""
    await _lock_table(ctx.app)
    async with ctx.transaction() as tx:
        stocks = await _stocks(ctx, tx, cmd.lines)
        wanted: dict[str, int] = {}
        for line in cmd.lines:
            wanted[line.sku] = wanted.get(line.sku, 0) + line.qty
        short = [
            f"{qty} x {sku} asked, {stocks[sku].available} available"
            for sku, qty in wanted.items()
            if cmd.order_id not in stocks[sku].held and qty > stocks[sku].available
        ]
        if short:
            await _save(ctx, stocks)  # a first-use seed, if any
            log.info("order %s: rejected (%s)", cmd.order_id, "; ".join(short))
            await ctx.publish(StockRejected(order_id=cmd.order_id, reason="; ".join(short)))
            return
        for sku, qty in wanted.items():
            stocks[sku].hold(cmd.order_id, qty)
        await _save(ctx, stocks)
        await ctx.publish(StockReserved(order_id=cmd.order_id))


@subscribe("shop.stock.release", group=GROUP, concurrency=8, retry=10, timeout=10.0)
async def release(cmd: ReleaseStock, ctx: Context) -> None:
    """Undo a reservation (the saga's compensation); nothing held: nothing to do. When
    this group has not handled the reserve yet, eventflow cancels it instead and this
    handler is not called."""
    await _lock_table(ctx.app)
    async with ctx.transaction() as tx:
        stocks = await _stocks(ctx, tx, cmd.lines)
        for stock in stocks.values():
            stock.free(cmd.order_id)
        await _save(ctx, stocks)


@subscribe("shop.shipping.shipped", group=GROUP, concurrency=8, retry=10, timeout=10.0)
async def deduct(event: OrderShipped, ctx: Context) -> None:
    """The order left the warehouse: its reserved units leave on hand (once per order,
    however many times shipping said so)."""
    await _lock_table(ctx.app)
    async with ctx.transaction() as tx:
        stocks = await _stocks(ctx, tx, event.lines)
        for stock in stocks.values():
            stock.deduct(event.order_id)
        await _save(ctx, stocks)


def create_app(config: Settings = settings, **options: Any) -> App:
    """The inventory ``App`` on ``config``'s broker and the inventory's own store."""
    return App(
        "shop-inventory",
        broker=config.broker,
        store=config.store_for("inventory"),
        handlers=[reserve, release, deduct],
        projections=[StockLevels()],
        metrics=config.metrics or None,
        **options,
    )


async def seed(app: App) -> None:
    """Put the catalog's stock on the shelf, once (a SKU that has a stream is left as it
    is; another instance seeding at the same time makes this one's append conflict, and
    its stock stands)."""
    await _lock_table(app)  # before the first reservations (their handlers make it too)
    repo = Repository(Stock, app.store, source=app.name)
    for sku, item in CATALOG.items():
        if await repo.exists(sku):
            continue
        stock = Stock(id=sku)
        stock.record(StockSeeded(sku=sku, qty=item.initial_stock))
        with contextlib.suppress(ConcurrencyError):
            await repo.create(stock)


async def stock_levels(app: App) -> tuple[int, dict[str, Any]]:
    """``GET /stock``: ``{sku: {"on_hand", "reserved"}}`` from the projection."""
    async with app.store.transaction() as tx:
        await StockLevels().setup(tx)  # answers (empty) before the projection's first batch
        rows = await tx.fetch("SELECT sku, on_hand, reserved FROM stock_levels ORDER BY sku")
    return 200, {sku: {"on_hand": on_hand, "reserved": held} for sku, on_hand, held in rows}


def create_http(app: App) -> FastAPI:
    """The inventory's FastAPI app: its lifespan runs ``app`` (and seeds the stock);
    ``GET /stock``, ``/healthz``, ``/readyz`` and ``/metrics``."""

    @asynccontextmanager
    async def seeded(_: object) -> Any:
        await seed(app)
        yield

    http = service_http(app, "shop inventory", inner=seeded)

    @http.get("/stock")
    async def get_stock() -> Response:
        status, body = await stock_levels(app)
        return JSONResponse(body, status_code=status)

    return http


app = create_app()
"""The inventory service of this process (``eventflow run examples.shop.inventory:app``)."""


def __getattr__(name: str) -> Any:
    # ``http`` needs FastAPI (pip install 'eventflow[fastapi]'): built on first use, so
    # that the rest of the module imports without it.
    if name == "http":
        built = globals()["http"] = create_http(app)
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
