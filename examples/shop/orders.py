"""The orders service: the HTTP API and the order saga.

    uvicorn examples.shop.orders:http --port $SHOP_ORDERS_PORT

- ``POST /orders`` validates the body and saves an ``Order`` aggregate: ``OrderPlaced`` is
  appended to the stream ``order-<id>`` (``expected_version=0``, so posting the same id
  again places nothing new) and the app's event relay publishes it. ``202`` with a
  ``Location``; with ``?wait=5`` it asks (``app.request``) to be told when the order ends,
  and answers ``200`` with the final order if that happens within 5 s.
- ``OrderSaga`` (in ``order_saga.py``, with the watches of ``?wait``) runs here:
  reserve (inventory) -> charge (payments, the pivot) -> ship (shipping). A rejected or
  timed-out step before the pivot compensates what was done, newest first; ship, after
  the pivot, is sent again until it works. ``OrderCancelled`` aborts it (before the pivot).
- ``GET /orders/{id}`` answers from the order's stream and its saga (status, step, reason);
  ``GET /orders?status=`` from the ``orders`` projection and the saga index;
  ``GET /orders/{id}/trace`` is the causal tree of the order's correlation id.

The routes are thin: each calls one function of this module (``place_order``,
``cancel_order``, ``get_order``, ``list_orders``, ``order_trace``) that takes the ``App``
and returns ``(status, body)``, which is also what ``eventflow demo`` calls without FastAPI.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eventflow import (
    Aggregate,
    AggregateNotFound,
    App,
    ConcurrencyError,
    Envelope,
    Projection,
    ProjectionContext,
    RequestTimeoutError,
    Saga,
    Transaction,
    on,
)

from .catalog import CATALOG, amount_cents
from .events import (
    OUTCOME_TOPIC,
    Line,
    OrderCancelled,
    OrderPlaced,
    OrderSettled,
    WatchOrder,
)
from .order_saga import WATCH_GROUP, OrderSaga, track
from .settings import Settings, settings
from .web import service_http

try:  # the HTTP API (pip install 'eventflow[fastapi]'); the rest works without it
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
except ImportError:  # pragma: no cover - eventflow demo on the core dependencies
    FastAPI = None  # type: ignore[assignment,misc]

__all__ = [
    "WATCH_GROUP",
    "Order",
    "OrderIn",
    "OrderSaga",
    "OrdersView",
    "cancel_order",
    "create_app",
    "create_http",
    "get_order",
    "list_orders",
    "order_trace",
    "place_order",
]

MAX_WAIT = 30.0


# -- the order: an aggregate, and a projection of all orders ---------------------------------


class Order(Aggregate, stream="order"):
    """One order as the customer placed it (what happened to it is its saga's)."""

    customer: str = ""
    lines: list[Line] = []
    amount_cents: int = 0
    cancelled: bool = False

    def place(self, customer: str, lines: list[Line]) -> None:
        """Record the order (a new aggregate only)."""
        amount = amount_cents([(line.sku, line.qty) for line in lines])
        self.record(
            OrderPlaced(order_id=self.id, customer=customer, lines=lines, amount_cents=amount)
        )

    def cancel(self) -> None:
        """Record the customer's cancellation (once)."""
        if not self.cancelled:
            self.record(OrderCancelled(order_id=self.id))

    @on(OrderPlaced)
    def _placed(self, e: OrderPlaced) -> None:
        self.customer, self.lines, self.amount_cents = e.customer, list(e.lines), e.amount_cents

    @on(OrderCancelled)
    def _cancelled(self, e: OrderCancelled) -> None:
        self.cancelled = True


class OrdersView(Projection, name="orders"):
    """``shop_orders (order_id, customer, lines, amount_cents)``: the list of orders."""

    async def setup(self, tx: Transaction) -> None:
        """Create the table (idempotent)."""
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS shop_orders (order_id TEXT PRIMARY KEY, "
            "customer TEXT NOT NULL, lines TEXT NOT NULL, amount_cents INTEGER NOT NULL)"
        )

    async def reset(self, tx: Transaction) -> None:
        """Empty the table before a rebuild."""
        await tx.execute("DELETE FROM shop_orders")

    @on(OrderPlaced)
    async def _placed(self, e: OrderPlaced, ctx: ProjectionContext) -> None:
        lines = orjson.dumps([line.model_dump() for line in e.lines]).decode()
        await ctx.transaction().execute(
            "INSERT INTO shop_orders (order_id, customer, lines, amount_cents) "
            "VALUES ($1, $2, $3, $4) ON CONFLICT (order_id) DO NOTHING",
            e.order_id,
            e.customer,
            lines,
            e.amount_cents,
        )


def _status(saga_status: str | None) -> str:
    """The order's status from its saga's: ``pending`` until the saga ends."""
    if saga_status is None or saga_status in ("pending", "running", "compensating"):
        return "pending"
    return saga_status


_FORWARD = ("command-sent", "replied", "rejected", "timed-out", "step-done", "retry-scheduled")
# The saga's local steps that only announce its end: not where an order is.
_ANNOUNCE = ("accept", "close")


def _step(saga: Saga | None) -> str | None:
    """The step the saga is at, or the one it ended at (``ship`` for a completed order,
    the one that failed for a compensated one)."""
    if saga is None:
        return None
    return next(
        (
            t.step
            for t in reversed(saga.history)
            if t.kind in _FORWARD and t.step and t.step not in _ANNOUNCE
        ),
        None,
    )


def _body(order: Order, saga: OrderSaga | None) -> dict[str, Any]:
    return {
        "order_id": order.id,
        "status": _status(saga.status if saga is not None else None),
        "customer": order.customer,
        "lines": [line.model_dump() for line in order.lines],
        "amount": order.amount_cents / 100,
        "step": _step(saga),
        "reason": saga.reason if saga is not None else None,
    }


# -- what the routes call ------------------------------------------------------------------

Result = tuple[int, dict[str, Any]]


class LineIn(BaseModel):
    """One line of ``POST /orders``."""

    model_config = ConfigDict(extra="forbid")
    sku: str
    qty: int = Field(ge=1, le=100_000)

    @field_validator("sku")
    @classmethod
    def _known(cls, sku: str) -> str:
        if sku not in CATALOG:
            raise ValueError(f"unknown sku {sku!r}: one of {', '.join(CATALOG)}")
        return sku


class OrderIn(BaseModel):
    """The body of ``POST /orders``."""

    model_config = ConfigDict(extra="forbid")
    order_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
    customer: str = Field(min_length=1, max_length=200)
    lines: list[LineIn] = Field(min_length=1, max_length=100)


def _repo(app: App) -> Any:
    return app.repository(Order)


async def _load(app: App, order_id: str) -> Order | None:
    try:
        order: Order = await _repo(app).load(order_id)
    except AggregateNotFound:
        return None
    return order


async def _correlation(app: App, order_id: str) -> str | None:
    async for rec in app.store.read_stream(f"order-{order_id}", limit=1):
        return rec.envelope.correlation_id
    return None


async def get_order(app: App, order_id: str) -> Result:
    """``GET /orders/{id}``: ``200`` with the order, ``404`` if there is none."""
    order = await _load(app, order_id)
    if order is None:
        return 404, {"detail": f"no order {order_id!r}"}
    return 200, _body(order, await app.sagas.get(OrderSaga, order_id))


async def place_order(app: App, payload: Any, *, wait: float = 0.0) -> Result:
    """``POST /orders``: ``202`` (placed, or placed before: idempotent), ``200`` with the
    final order when ``wait`` > 0 and it ends within ``wait`` seconds, ``422`` on a bad
    body."""
    try:
        order_in = OrderIn.model_validate(payload)
    except ValidationError as exc:
        return 422, {"detail": orjson.loads(exc.json(include_url=False))}
    order_id = order_in.order_id or f"o-{uuid.uuid4().hex[:12]}"
    order = Order(id=order_id)
    order.place(order_in.customer, [Line(sku=x.sku, qty=x.qty) for x in order_in.lines])
    try:
        await _repo(app).create(order)
    except ConcurrencyError:  # placed before: one order, one saga
        fresh = None
    else:
        fresh = order  # what the order's stream now holds: no need to read it back
    wait = min(max(wait, 0.0), MAX_WAIT)
    if wait > 0:
        try:
            await app.request(
                WatchOrder(order_id=order_id),
                expect=OrderSettled,
                timeout=wait,
                key=order_id,
                topic=OUTCOME_TOPIC,
                correlation_id=await _correlation(app, order_id),
            )
        except RequestTimeoutError:
            pass  # still running: the caller looks later (Location)
        else:
            if fresh is not None:
                return 200, _body(fresh, await app.sagas.get(OrderSaga, order_id))
            return await get_order(app, order_id)
    saga = await app.sagas.get(OrderSaga, order_id)
    return 202, {"order_id": order_id, "status": _status(saga.status if saga else None)}


async def cancel_order(app: App, order_id: str) -> Result:
    """``POST /orders/{id}/cancel``: ``202`` (the saga aborts and compensates), ``409``
    once the order completed, ``404`` if there is none."""
    order = await _load(app, order_id)
    if order is None:
        return 404, {"detail": f"no order {order_id!r}"}
    saga = await app.sagas.get(OrderSaga, order_id)
    if saga is not None and saga.status == "completed":
        return 409, {"detail": f"order {order_id!r} is completed: it cannot be cancelled"}
    placed: Envelope | None = None
    async for rec in app.store.read_stream(f"order-{order_id}", limit=1):
        placed = rec.envelope  # the cancellation continues the order's correlation
    await _repo(app).update(order_id, lambda o: o.cancel(), caused_by=placed)
    return 202, {"order_id": order_id, "status": _status(saga.status if saga else None)}


async def list_orders(app: App, status: str | None = None) -> Result:
    """``GET /orders[?status=S]``: every order (or those with status S), from the
    ``orders`` projection and the saga index (step and reason for those that did not
    complete)."""
    async with app.store.transaction() as tx:
        await OrdersView().setup(tx)  # answers (empty) before the projection's first batch
        rows = await tx.fetch(
            "SELECT order_id, customer, lines, amount_cents FROM shop_orders ORDER BY order_id"
        )
    index = {row.key: row.status for row in await app.sagas.list(name="order", limit=1_000_000)}
    out = []
    for order_id, customer, lines, cents in rows:
        shown = _status(index.get(order_id))
        if status is not None and shown != status:
            continue
        step_name = reason = None
        if shown in ("compensated", "failed"):
            saga = await app.sagas.get(OrderSaga, order_id)
            step_name, reason = _step(saga), saga.reason if saga is not None else None
        out.append(
            {
                "order_id": order_id,
                "status": shown,
                "customer": customer,
                "lines": orjson.loads(lines),
                "amount": cents / 100,
                "step": step_name,
                "reason": reason,
            }
        )
    return 200, {"orders": out}


async def order_trace(app: App, order_id: str) -> Result:
    """``GET /orders/{id}/trace``: the causal tree of the order's correlation id, as
    ``eventflow trace`` draws it from this service's store (``tree``, one line each), and
    the messages it holds (``messages``)."""
    from eventflow.cli.trace import collect, render

    correlation = await _correlation(app, order_id)
    if correlation is None:
        return 404, {"detail": f"no order {order_id!r}"}
    nodes = await collect(app.store, correlation)
    messages = []
    for node in nodes:
        env = node.envelope
        assert env is not None
        item: dict[str, Any] = {"id": env.id, "type": env.type, "where": node.where}
        item |= {"causation_id": env.causation_id, "time": env.time.isoformat()}
        if node.saga is not None:
            item["saga_transition"] = node.saga.transition
        messages.append(item)
    return 200, {
        "order_id": order_id,
        "correlation_id": correlation,
        "tree": render(correlation, nodes).splitlines(),
        "messages": messages,
    }


# -- the service ---------------------------------------------------------------------------


def create_app(config: Settings = settings, **options: Any) -> App:
    """The orders ``App``: the saga, the watch handler, the ``orders`` projection and the
    event relay (which publishes ``OrderPlaced`` and ``OrderCancelled``)."""
    return App(
        "shop-orders",
        broker=config.broker,
        store=config.store_for("orders"),
        handlers=[track],
        sagas=[OrderSaga],
        projections=[OrdersView()],
        relay_events=True,
        metrics=config.metrics or None,
        **options,
    )


def create_http(app: App) -> FastAPI:
    """The orders' FastAPI app; its lifespan runs ``app`` (eventflow.asgi)."""
    http = service_http(app, "shop orders")

    def answer(result: Result, headers: dict[str, str] | None = None) -> Response:
        status, body = result
        return JSONResponse(body, status_code=status, headers=headers)

    @http.post("/orders")
    async def post_order(request: Request, wait: float = 0.0) -> Response:
        try:
            payload = await request.json()
        except ValueError:
            payload = None
        status, body = await place_order(app, payload, wait=wait)
        where = {"Location": f"/orders/{body['order_id']}"} if status in (200, 202) else None
        return answer((status, body), where)

    @http.post("/orders/{order_id}/cancel")
    async def post_cancel(order_id: str) -> Response:
        return answer(await cancel_order(app, order_id))

    @http.get("/orders/{order_id}")
    async def get_one(order_id: str) -> Response:
        return answer(await get_order(app, order_id))

    @http.get("/orders")
    async def get_all(status: str | None = None) -> Response:
        return answer(await list_orders(app, status))

    @http.get("/orders/{order_id}/trace")
    async def get_trace(order_id: str) -> Response:
        return answer(await order_trace(app, order_id))

    return http


app = create_app()
"""The orders service of this process."""


def __getattr__(name: str) -> Any:
    # ``http`` needs FastAPI (pip install 'eventflow[fastapi]'): built on first use, so
    # that the rest of the module imports without it.
    if name == "http":
        built = globals()["http"] = create_http(app)
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
