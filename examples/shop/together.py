"""The whole shop in one process: the embedded form (memory broker + SQLite by default).

    async with together.running() as shop:
        status, body = await shop.client.place({"customer": "c-1", "lines": [...]}, wait=5)

The four services are the same ``App``s as when each runs on its own (``create_app`` of
each module), on one broker: the ``memory://`` broker lives inside a process, which is why
they must share one to talk. Before any of them starts, every service's consumer groups are
declared (``eventflow groups declare`` does the same from the command line), so no command
the saga sends can be missed by a participant that has not joined yet; then the
participants start, then orders.

With FastAPI and httpx installed (``pip install 'eventflow[fastapi]' httpx``) the HTTP APIs
run too, in-process: the client calls them through ``httpx.ASGITransport``, and payments
calls the provider the same way. Without them the client calls the functions the routes
call (``orders.place_order``, ...) and payments calls the provider's object directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from eventflow import App
from eventflow.brokers import open_broker
from eventflow.groups import declare_groups

from . import inventory, orders, payments, provider, shipping
from .settings import Settings, settings

__all__ = ["DirectClient", "HttpClient", "Shop", "ShopClient", "http_available", "running"]

Result = tuple[int, Any]


def http_available() -> bool:
    """Whether FastAPI and httpx can be imported (the HTTP APIs can run)."""
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
    except ImportError:
        return False
    return True


class ShopClient(Protocol):
    """The shop's HTTP API as calls: each returns ``(status, body)``."""

    async def place(self, order: Any, *, wait: float = 0.0) -> Result:
        """``POST /orders[?wait=S]``."""

    async def cancel(self, order_id: str) -> Result:
        """``POST /orders/{id}/cancel``."""

    async def get(self, order_id: str) -> Result:
        """``GET /orders/{id}``."""

    async def orders(self, status: str | None = None) -> Result:
        """``GET /orders[?status=S]``."""

    async def trace(self, order_id: str) -> Result:
        """``GET /orders/{id}/trace``."""

    async def stock(self) -> Result:
        """``GET /stock`` (inventory)."""

    async def charges(self) -> Result:
        """``GET /charges`` (the provider)."""


class HttpClient:
    """The API over HTTP: three ``httpx.AsyncClient``s (orders, inventory, provider), on
    URLs or, in-process, on ``httpx.ASGITransport``s."""

    def __init__(self, orders_client: Any, inventory_client: Any, provider_client: Any) -> None:
        self._orders, self._inventory, self._provider = (
            orders_client,
            inventory_client,
            provider_client,
        )

    @staticmethod
    def _result(r: Any) -> Result:
        return r.status_code, r.json()

    async def place(self, order: Any, *, wait: float = 0.0) -> Result:
        params = {"wait": wait} if wait else None
        return self._result(await self._orders.post("/orders", json=order, params=params))

    async def cancel(self, order_id: str) -> Result:
        return self._result(await self._orders.post(f"/orders/{order_id}/cancel"))

    async def get(self, order_id: str) -> Result:
        return self._result(await self._orders.get(f"/orders/{order_id}"))

    async def orders(self, status: str | None = None) -> Result:
        params = {"status": status} if status else None
        return self._result(await self._orders.get("/orders", params=params))

    async def trace(self, order_id: str) -> Result:
        return self._result(await self._orders.get(f"/orders/{order_id}/trace"))

    async def stock(self) -> Result:
        return self._result(await self._inventory.get("/stock"))

    async def charges(self) -> Result:
        return self._result(await self._provider.get("/charges"))


class DirectClient:
    """The API as the functions its routes call, without HTTP (no FastAPI installed)."""

    def __init__(self, shop: Shop, bank: provider.Provider) -> None:
        self._shop, self._bank = shop, bank

    async def place(self, order: Any, *, wait: float = 0.0) -> Result:
        return await orders.place_order(self._shop.orders, order, wait=wait)

    async def cancel(self, order_id: str) -> Result:
        return await orders.cancel_order(self._shop.orders, order_id)

    async def get(self, order_id: str) -> Result:
        return await orders.get_order(self._shop.orders, order_id)

    async def orders(self, status: str | None = None) -> Result:
        return await orders.list_orders(self._shop.orders, status)

    async def trace(self, order_id: str) -> Result:
        return await orders.order_trace(self._shop.orders, order_id)

    async def stock(self) -> Result:
        return await inventory.stock_levels(self._shop.inventory)

    async def charges(self) -> Result:
        status, body, _ = await self._bank.charges()
        return status, body


@dataclass
class Shop:
    """The running shop: its four apps, the client of its API, and how it is called."""

    orders: App
    inventory: App
    payments: App
    shipping: App
    config: Settings
    over_http: bool
    client: ShopClient = None  # type: ignore[assignment]  # set once the apps run

    @property
    def apps(self) -> tuple[App, ...]:
        """The four apps, participants first."""
        return (self.inventory, self.payments, self.shipping, self.orders)


@asynccontextmanager
async def running(
    config: Settings = settings,
    *,
    http: bool | None = None,
    wrap_provider: Callable[[payments.ProviderClient], payments.ProviderClient] | None = None,
    **app_options: Any,
) -> AsyncIterator[Shop]:
    """Run the four services (and the provider) in this process for the block.

    ``http`` None: over HTTP when FastAPI and httpx are installed. ``wrap_provider`` wraps
    the client payments calls the provider with (a test's outage, say). ``app_options`` go
    to every ``App`` (``tracing=provider``, say)."""
    over_http = http_available() if http is None else http
    async with AsyncExitStack() as stack:
        if over_http:
            import httpx

            bank_http = provider.create_http(config)
            await stack.enter_async_context(bank_http.router.lifespan_context(bank_http))
            bank: provider.Provider = bank_http.state.provider
            bank_client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=bank_http), base_url="http://provider"
            )
            await stack.enter_async_context(bank_client)
            over_asgi = payments.HttpProvider(
                "http://provider", transport=httpx.ASGITransport(app=bank_http)
            )
            stack.push_async_callback(over_asgi.aclose)  # after payments stopped
            to_bank: payments.ProviderClient = over_asgi
        else:
            bank = await stack.enter_async_context(provider.running(config))
            to_bank = payments.DirectProvider(bank)
        shop = Shop(
            orders=orders.create_app(config, **app_options),
            inventory=inventory.create_app(config, **app_options),
            payments=payments.create_app(
                config, provider=wrap_provider(to_bank) if wrap_provider else to_bank, **app_options
            ),
            shipping=shipping.create_app(config, **app_options),
            config=config,
            over_http=over_http,
        )
        # Every group first, so that what the saga sends waits for its participant. The
        # broker stays open to the end: the memory broker's hub lives as long as a broker
        # uses it.
        broker = open_broker(config.broker)
        await broker.start()
        stack.push_async_callback(broker.close)
        async for _ in declare_groups(broker, [s for app in shop.apps for s in app.subscriptions]):
            pass
        if over_http:
            inventory_http = inventory.create_http(shop.inventory)
            orders_http = orders.create_http(shop.orders)
            await stack.enter_async_context(inventory_http.router.lifespan_context(inventory_http))
            await stack.enter_async_context(shop.payments)
            await stack.enter_async_context(shop.shipping)
            await stack.enter_async_context(orders_http.router.lifespan_context(orders_http))
            clients = [
                httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url=f"http://{n}")
                for a, n in ((orders_http, "orders"), (inventory_http, "inventory"))
            ]
            for c in clients:
                await stack.enter_async_context(c)
            shop.client = HttpClient(clients[0], clients[1], bank_client)
        else:
            await stack.enter_async_context(shop.inventory)
            await inventory.seed(shop.inventory)
            await stack.enter_async_context(shop.payments)
            await stack.enter_async_context(shop.shipping)
            await stack.enter_async_context(shop.orders)
            shop.client = DirectClient(shop, bank)
        yield shop


SAMPLE = (
    ("o-1", [("sku-1", 2), ("sku-5", 3)], "placed"),
    ("o-2", [("sku-3", 5)], "placed"),  # 600.00: above the payments limit
    ("o-3", [("sku-4", 21)], "placed"),  # the shelf holds 20
    ("o-4", [("sku-2", 1)], "cancelled"),  # cancelled right after it was placed
)
"""The orders ``python -m examples.shop.together`` places."""


async def main(config: Settings = settings) -> None:
    """Place the ``SAMPLE`` orders and print how each ended (the stores stay behind)."""
    async with running(config) as shop:
        for order_id, lines, what in SAMPLE:
            body = {
                "order_id": order_id,
                "customer": "c-1",
                "lines": [{"sku": sku, "qty": qty} for sku, qty in lines],
            }
            if what == "cancelled":
                await shop.client.place(body)
                await shop.client.cancel(order_id)
            else:
                await shop.client.place(body, wait=10)
        for app in (*shop.apps, *shop.apps):
            await app.wait_idle(timeout=30)
        for order_id, _, _ in SAMPLE:
            _, order = await shop.client.get(order_id)
            print(" ".join(filter(None, (order_id, order["status"], order["reason"]))))


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
