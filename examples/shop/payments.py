"""The payments service: charges and refunds orders through the (fake) payment provider.

    eventflow run examples.shop.payments:app [--port 9464]

- It declines a charge above ``SHOP_DECLINE_ABOVE`` itself (``PaymentDeclined``: the saga
  compensates what came before).
- It calls the provider inside ``ctx.limit("payment-provider")``: a named ``Limit`` (at most
  16 calls at once, 200 a second) with a circuit breaker that opens after 20 failures in
  10 s. An open breaker gives messages back without spending their attempts and pauses
  the subscriptions that use it, so an outage sends nothing to the dead-letter queue.
- Every charge carries ``ctx.idempotency_key`` as its ``Idempotency-Key``: the same for
  every retry and redelivery of one command, so a retried charge (after a ``503`` whose
  charge went through, a crash before the ack) never charges twice.
- A ``429`` with ``Retry-After`` becomes ``RetryLater(after=...)``.
- What was charged is recorded in the payments store (``payment-<order id>``), in the same
  transaction as the reply, so a refund of a charge that timed out finds it by order id.

The provider is reached over HTTP at ``SHOP_PROVIDER_URL`` (needs ``httpx``); the
one-process form passes a client of its own to :func:`create_app`.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from eventflow import (
    App,
    Breaker,
    Context,
    Limit,
    RetryLater,
    subscribe,
)

from .events import (
    ChargePayment,
    PaymentCaptured,
    PaymentCharged,
    PaymentDeclined,
    PaymentRefunded,
    PaymentReturned,
    RefundPayment,
)
from .settings import Settings, settings

__all__ = [
    "GROUP",
    "LIMIT",
    "DirectProvider",
    "HttpProvider",
    "ProviderBusy",
    "ProviderClient",
    "ProviderDown",
    "create_app",
]

log = logging.getLogger("shop.payments")

GROUP = "shop-payments"
LIMIT = "payment-provider"


class ProviderDown(Exception):
    """The provider did not answer, or answered 5xx: counted by the breaker, retried."""


class ProviderBusy(Exception):
    """The provider answered 429: try again no sooner than ``retry_after`` seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"provider busy: retry after {retry_after}s")
        self.retry_after = retry_after


class ProviderClient(Protocol):
    """How payments reaches the provider (over HTTP, or in-process)."""

    async def charge(self, key: str, order_id: str, amount_cents: int) -> str:
        """Charge once per ``key``; return the charge id."""

    async def refund(self, order_id: str, charge_id: str | None) -> None:
        """Refund the order's charge (or all of its charges)."""


def _check(status: int, body: Any, headers: Any) -> Any:
    """The provider's answer, or the exception that says what to do about it."""
    if status == 429:
        raise ProviderBusy(float(headers.get("Retry-After", "1")))
    if status >= 500:
        raise ProviderDown(f"provider answered {status}")
    if status >= 400:  # a bug of ours: retried, then dead-lettered with the text
        raise RuntimeError(f"provider refused the request ({status}): {body}")
    return body


class HttpProvider:
    """The provider over HTTP (``httpx``): ``HttpProvider("http://127.0.0.1:8002")``, or
    with ``transport=httpx.ASGITransport(app=provider.http)`` in-process."""

    def __init__(self, base_url: str, *, transport: Any = None, timeout: float = 5.0) -> None:
        import httpx  # in eventflow[test]; the payments service needs it

        self._errors = (httpx.TransportError,)
        self._client = httpx.AsyncClient(base_url=base_url, transport=transport, timeout=timeout)

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        try:
            r = await self._client.post(path, json=body, headers=headers)
        except self._errors as exc:
            raise ProviderDown(f"provider unreachable: {type(exc).__name__}: {exc}") from exc
        return _check(r.status_code, r.json(), r.headers)

    async def charge(self, key: str, order_id: str, amount_cents: int) -> str:
        """``POST /charges`` with ``Idempotency-Key``."""
        body = {"order_id": order_id, "amount_cents": amount_cents}
        return str((await self._post("/charges", body, {"Idempotency-Key": key}))["id"])

    async def refund(self, order_id: str, charge_id: str | None) -> None:
        """``POST /refunds``."""
        await self._post("/refunds", {"order_id": order_id, "charge_id": charge_id}, {})

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()


class DirectProvider:
    """The provider called in this process, without HTTP (the demo without FastAPI): the
    same answers, the same mapping of 429 and 503."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider

    async def charge(self, key: str, order_id: str, amount_cents: int) -> str:
        """What ``POST /charges`` would answer."""
        body = {"order_id": order_id, "amount_cents": amount_cents}
        return str(_check(*await self._provider.charge(key, body))["id"])

    async def refund(self, order_id: str, charge_id: str | None) -> None:
        """What ``POST /refunds`` would answer."""
        _check(*await self._provider.refund({"order_id": order_id, "charge_id": charge_id}))


def create_app(
    config: Settings = settings, *, provider: ProviderClient | None = None, **options: Any
) -> App:
    """The payments ``App``; ``provider`` defaults to HTTP at ``config.provider_url``."""
    client: ProviderClient = provider or HttpProvider(config.provider_url)
    decline_above = config.decline_above_cents

    @subscribe("shop.payment.charge", group=GROUP, concurrency=16, retry=12, timeout=15.0)
    async def charge(cmd: ChargePayment, ctx: Context) -> None:
        """Charge the order, or decline it above the limit."""
        if cmd.amount_cents > decline_above:
            reason = f"{cmd.amount_cents / 100:.2f} is above the limit of {decline_above / 100:.2f}"
            await ctx.publish(PaymentDeclined(order_id=cmd.order_id, reason=reason))
            return
        try:
            async with ctx.limit(LIMIT):
                charge_id = await client.charge(ctx.idempotency_key, cmd.order_id, cmd.amount_cents)
        except ProviderBusy as busy:
            raise RetryLater(after=busy.retry_after) from busy
        async with ctx.transaction():
            captured = PaymentCaptured(
                order_id=cmd.order_id, charge_id=charge_id, amount_cents=cmd.amount_cents
            )
            await ctx.store.append(f"payment-{cmd.order_id}", [captured])
            await ctx.publish(PaymentCharged(order_id=cmd.order_id, charge_id=charge_id))

    @subscribe("shop.payment.refund", group=GROUP, concurrency=16, retry=12, timeout=15.0)
    async def refund(cmd: RefundPayment, ctx: Context) -> None:
        """Refund what was charged for the order (nothing charged: nothing to refund)."""
        charge_ids = [cmd.charge_id] if cmd.charge_id else []
        if not charge_ids:  # the charge timed out: refund by order id
            async for rec in ctx.store.read_stream(f"payment-{cmd.order_id}"):
                if isinstance(rec.event, PaymentCaptured):
                    charge_ids.append(rec.event.charge_id)
        try:
            async with ctx.limit(LIMIT):
                await client.refund(cmd.order_id, cmd.charge_id)
        except ProviderBusy as busy:
            raise RetryLater(after=busy.retry_after) from busy
        async with ctx.transaction():
            returned = [PaymentReturned(order_id=cmd.order_id, charge_id=c) for c in charge_ids]
            if returned:
                await ctx.store.append(f"payment-{cmd.order_id}", returned)
            await ctx.publish(PaymentRefunded(order_id=cmd.order_id))

    breaker = Breaker(failures=20, window=10.0, reset=1.0, on=(ProviderDown,))
    return App(
        "shop-payments",
        broker=config.broker,
        store=config.store_for("payments"),
        handlers=[charge, refund],
        limits=[Limit(LIMIT, concurrency=16, rate=200.0, burst=20, breaker=breaker)],
        metrics=config.metrics or None,
        **options,
    )


def __getattr__(name: str) -> Any:
    # ``app`` talks HTTP to the provider (httpx): built on first use, so that the module
    # imports without httpx (the demo's one-process form passes its own client).
    if name == "app":
        built = globals()["app"] = create_app()
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
