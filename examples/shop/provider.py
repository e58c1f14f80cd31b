"""The fake payment provider: a small bank the payments service calls over HTTP.

    uvicorn examples.shop.provider:http --port $SHOP_PROVIDER_PORT

- ``POST /charges`` (header ``Idempotency-Key``, body ``{"order_id", "amount_cents"}``):
  charges once per key; the same key again answers the first charge (``200``, not
  ``201``), as Stripe's idempotency keys do.
- ``POST /refunds`` (body ``{"order_id", "charge_id"}``, ``charge_id`` optional): refunds
  the order's charges (that one, or all of the order's), ``200`` even when there is nothing
  to refund.
- ``GET /charges``: ``{"charges": [{"key", "order_id", "amount", "refunded"}]}``, one row
  per key: what the tests read to check that nothing was charged twice.

It is flaky on purpose: a share ``SHOP_PROVIDER_FLAKY`` of calls is answered ``429`` with
``Retry-After`` (nothing done) or ``503`` *after* doing the work (the answer is lost, as
when a connection drops): a client that retries with the same idempotency key still
charges once. Its charges are kept in its own store's SQL (``shop-provider.db``, or the
schema ``shop_provider``), through eventflow's store transactions.
"""

from __future__ import annotations

import random
import uuid
from contextlib import asynccontextmanager
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from eventflow import MissingDependencyError, open_store
from eventflow.ports import Store

from .settings import Settings, settings

try:  # the HTTP API (pip install 'eventflow[fastapi]'); the rest works without it
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
except ImportError:  # pragma: no cover - eventflow demo on the core dependencies
    FastAPI = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

__all__ = ["Answer", "Provider", "create_http", "running"]

Answer = tuple[int, dict[str, Any], dict[str, str]]
"""What the provider answers: HTTP status, JSON body, headers."""

_TABLE = (
    "CREATE TABLE IF NOT EXISTS provider_charges (key TEXT PRIMARY KEY, charge_id TEXT NOT NULL,"
    " order_id TEXT NOT NULL, amount_cents INTEGER NOT NULL, refunded INTEGER NOT NULL)"
)


class Provider:
    """The provider's behaviour on an open store: what the routes (and the one-process
    form without FastAPI) call."""

    def __init__(self, store: Store, config: Settings = settings, *, seed: int | None = None):
        self.store = store
        self.flaky = config.provider_flaky
        self.retry_after = config.provider_retry_after
        self._random = random.Random(seed)

    async def setup(self) -> None:
        """Create the provider's table (idempotent)."""
        async with self.store.transaction() as tx:
            await tx.execute(_TABLE)

    def _trouble(self) -> str | None:
        if self._random.random() >= self.flaky:
            return None
        return "busy" if self._random.random() < 0.5 else "lost"

    async def charge(self, key: str | None, body: Any) -> Answer:
        """``POST /charges``."""
        if not key:
            return 400, {"detail": "the Idempotency-Key header is required"}, {}
        try:
            order_id, amount = str(body["order_id"]), int(body["amount_cents"])
        except (KeyError, TypeError, ValueError):
            return 422, {"detail": "body: {'order_id': str, 'amount_cents': int}"}, {}
        trouble = self._trouble()
        if trouble == "busy":
            return 429, {"detail": "slow down"}, {"Retry-After": f"{self.retry_after:g}"}
        async with self.store.transaction() as tx:
            created = await tx.execute(
                "INSERT INTO provider_charges (key, charge_id, order_id, amount_cents, refunded)"
                " VALUES ($1, $2, $3, $4, 0) ON CONFLICT (key) DO NOTHING",
                key,
                f"ch_{uuid.uuid4().hex[:16]}",
                order_id,
                amount,
            )
            rows = await tx.fetch(
                "SELECT charge_id, order_id, amount_cents FROM provider_charges WHERE key = $1",
                key,
            )
        if trouble == "lost":
            return 503, {"detail": "try again"}, {}
        charge_id, kept_order, kept_amount = rows[0]
        status = 201 if created else 200  # 200: this key's first charge, answered again
        return status, {"id": charge_id, "order_id": kept_order, "amount_cents": kept_amount}, {}

    async def refund(self, body: Any) -> Answer:
        """``POST /refunds``: the order's charges (or the one named) marked refunded."""
        try:
            order_id = str(body["order_id"])
            charge_id = body.get("charge_id")
        except (KeyError, TypeError, AttributeError):
            return 422, {"detail": "body: {'order_id': str, 'charge_id': str | None}"}, {}
        if self._trouble() is not None:
            return 503, {"detail": "try again"}, {}
        async with self.store.transaction() as tx:
            if charge_id:
                await tx.execute(
                    "UPDATE provider_charges SET refunded = 1"
                    " WHERE order_id = $1 AND charge_id = $2",
                    order_id,
                    str(charge_id),
                )
            else:
                await tx.execute(
                    "UPDATE provider_charges SET refunded = 1 WHERE order_id = $1", order_id
                )
            rows = await tx.fetch(
                "SELECT charge_id FROM provider_charges WHERE order_id = $1 AND refunded = 1",
                order_id,
            )
        return 200, {"order_id": order_id, "refunded": [r[0] for r in rows]}, {}

    async def charges(self) -> Answer:
        """``GET /charges``: one row per idempotency key."""
        async with self.store.transaction() as tx:
            rows = await tx.fetch(
                "SELECT key, order_id, amount_cents, refunded FROM provider_charges ORDER BY key"
            )
        out = [
            {
                "key": key,
                "order_id": order_id,
                "amount": float(Decimal(cents) / 100),
                "refunded": bool(refunded),
            }
            for key, order_id, cents, refunded in rows
        ]
        return 200, {"charges": out}, {}


@asynccontextmanager
async def running(config: Settings = settings) -> AsyncIterator[Provider]:
    """The provider on its own store, open for the block."""
    async with open_store(config.store_for("provider")) as store:
        provider = Provider(store, config)
        await provider.setup()
        yield provider


def create_http(config: Settings = settings) -> FastAPI:
    """The provider's FastAPI app (its lifespan opens the provider's store)."""
    if FastAPI is None:
        raise MissingDependencyError("fastapi", "fastapi")

    @asynccontextmanager
    async def lifespan(http: FastAPI) -> AsyncIterator[None]:
        async with running(config) as provider:
            http.state.provider = provider
            yield

    http = FastAPI(title="fake payment provider", lifespan=lifespan)

    def answer(result: Answer) -> Response:
        status, body, headers = result
        return JSONResponse(body, status_code=status, headers=headers)

    async def json_body(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError:
            return None

    @http.post("/charges")
    async def charge(request: Request) -> Response:
        provider: Provider = request.app.state.provider
        key = request.headers.get("Idempotency-Key")
        return answer(await provider.charge(key, await json_body(request)))

    @http.post("/refunds")
    async def refund(request: Request) -> Response:
        provider: Provider = request.app.state.provider
        return answer(await provider.refund(await json_body(request)))

    @http.get("/charges")
    async def charges(request: Request) -> Response:
        provider: Provider = request.app.state.provider
        return answer(await provider.charges())

    @http.get("/healthz")
    async def healthz() -> Response:
        return PlainTextResponse("ok")

    @http.get("/readyz")
    async def readyz(request: Request) -> Response:
        ready = getattr(request.app.state, "provider", None) is not None
        return PlainTextResponse("ok" if ready else "starting", status_code=200 if ready else 503)

    return http


def __getattr__(name: str) -> Any:
    # ``http`` needs FastAPI (pip install 'eventflow[fastapi]'): built on first use.
    if name == "http":
        built = globals()["http"] = create_http(settings)
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
