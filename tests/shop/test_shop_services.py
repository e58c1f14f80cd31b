"""The shop's four services in one process (memory broker + SQLite, examples/shop/together.py),
called through their HTTP APIs in-process (httpx.ASGITransport): the outcomes the shop's
README promises, and the saga guarantees the shop relies on."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from eventflow import App
from eventflow.headers import COMPENSATES_HEADER
from examples.shop import payments, shipping, together
from examples.shop.catalog import CATALOG
from examples.shop.events import OrderCancelled, ReleaseStock, ReserveStock
from examples.shop.orders import OrderSaga
from examples.shop.settings import Settings, from_env


def _config(tmp_path: Path, broker_url: str, **overrides: Any) -> Settings:
    defaults = from_env({})  # no SHOP_* variable: the defaults (metrics on with the extra)
    return dataclasses.replace(
        defaults, broker=broker_url, store=f"sqlite:///{tmp_path / 'shop.db'}", **overrides
    )


@pytest.fixture
async def shop(tmp_path: Path, broker_url: str) -> AsyncIterator[together.Shop]:
    async with together.running(_config(tmp_path, broker_url), http=True) as running:
        yield running


def _order(order_id: str, *lines: tuple[str, int]) -> dict[str, Any]:
    return {
        "order_id": order_id,
        "customer": "c-1",
        "lines": [{"sku": s, "qty": q} for s, q in lines],
    }


async def _settle(shop: together.Shop) -> None:
    for app in (*shop.apps, *shop.apps):
        await app.wait_idle(timeout=60)


async def test_orders_end_as_their_input_dictates(shop: together.Shop) -> None:
    client = shop.client
    _, before = await client.stock()
    assert before == {
        sku: {"on_hand": item.initial_stock, "reserved": 0} for sku, item in CATALOG.items()
    }  # seeded from the catalog on first start

    status, body = await client.place(_order("o-ok", ("sku-1", 2), ("sku-5", 3)), wait=10)
    assert status == 200 and body["status"] == "completed" and body["amount"] == 40.0
    assert body["step"] == "ship"  # the last real step, not the local one announcing the end
    declined = _order("o-declined", ("sku-3", 5))  # 600.00 > SHOP_DECLINE_ABOVE (500.00)
    status, body = await client.place(declined, wait=10)
    assert (status, body["status"], body["step"]) == (200, "compensated", "charge")
    assert body["reason"] == "charge rejected (shop.payment.declined)"
    short = _order("o-short", ("sku-4", 21), ("sku-1", 1))  # 20 espresso machines on the shelf
    status, body = await client.place(short, wait=10)
    assert (status, body["status"], body["step"]) == (200, "compensated", "reserve")

    await _settle(shop)
    _, after = await client.stock()
    assert after["sku-1"] == {"on_hand": before["sku-1"]["on_hand"] - 2, "reserved": 0}
    assert after["sku-5"] == {"on_hand": before["sku-5"]["on_hand"] - 3, "reserved": 0}
    assert after["sku-3"] == before["sku-3"] and after["sku-4"] == before["sku-4"]
    _, charges = await client.charges()
    assert [(c["order_id"], c["amount"], c["refunded"]) for c in charges["charges"]] == [
        ("o-ok", 40.0, False)
    ]  # the declined order was never charged
    status, listed = await client.orders(status="compensated")
    assert status == 200 and sorted(o["order_id"] for o in listed["orders"]) == [
        "o-declined",
        "o-short",
    ]


async def test_post_is_idempotent_and_validates(shop: together.Shop) -> None:
    client = shop.client
    order = _order("o-twice", ("sku-2", 1))
    first, second = await client.place(order), await client.place(order)
    assert first == (202, {"order_id": "o-twice", "status": "pending"})
    assert second[0] == 202
    status, body = await client.get("o-twice")
    assert status == 200 and body["lines"] == [{"sku": "sku-2", "qty": 1}]
    await _settle(shop)
    assert len(await shop.orders.sagas.list(name="order")) == 1  # one order, one saga
    _, charges = await client.charges()
    assert len(charges["charges"]) == 1

    for bad in (
        {"customer": "c-1", "lines": []},
        {"customer": "c-1", "lines": [{"sku": "sku-9", "qty": 1}]},
        {"customer": "c-1", "lines": [{"sku": "sku-1", "qty": 0}]},
        {"lines": [{"sku": "sku-1", "qty": 1}]},
        None,
    ):
        status, body = await client.place(bad)
        assert status == 422, bad
    assert (await client.get("o-missing"))[0] == 404
    assert (await client.cancel("o-missing"))[0] == 404
    status, body = await client.place({"customer": "c-2", "lines": [{"sku": "sku-1", "qty": 1}]})
    assert status == 202 and body["order_id"].startswith("o-")  # an id is made when absent


async def test_the_http_api_says_where_to_look(shop: together.Shop) -> None:
    import httpx

    assert isinstance(shop.client, together.HttpClient)
    orders_http = shop.client._orders
    r = await orders_http.post("/orders", json=_order("o-loc", ("sku-1", 1)))
    assert r.status_code == 202 and r.headers["Location"] == "/orders/o-loc"
    r = await orders_http.post("/orders", content=b"{not json", headers={"content-type": "x"})
    assert r.status_code == 422
    assert (await orders_http.get("/readyz")).status_code == 200
    assert (await orders_http.get("/healthz")).text == "ok"
    metrics = await orders_http.get("/metrics")  # what Prometheus scrapes (the dashboard's)
    assert metrics.status_code == 200
    assert 'eventflow_messages_handled_total{group="saga.order"' in metrics.text
    stock_metrics = await shop.client._inventory.get("/metrics")
    assert 'eventflow_messages_handled_total{group="shop-inventory"' in stock_metrics.text
    assert isinstance(orders_http, httpx.AsyncClient)
    await _settle(shop)
    status, trace = await shop.client.trace("o-loc")
    assert status == 200 and trace["tree"][0].startswith(f"correlation {trace['correlation_id']}")
    kinds = [m["saga_transition"]["kind"] for m in trace["messages"] if "saga_transition" in m]
    assert kinds[0] == "started" and kinds[-1] == "completed"


async def test_cancel_right_after_placing_compensates_once(shop: together.Shop) -> None:
    client = shop.client
    assert (await client.place(_order("o-cancel", ("sku-2", 3))))[0] == 202
    assert (await client.cancel("o-cancel"))[0] == 202
    await _settle(shop)
    status, body = await client.get("o-cancel")
    assert (status, body["status"]) == (200, "compensated")
    assert body["reason"] == "aborted by shop.order.cancelled"
    _, stock = await client.stock()
    assert stock["sku-2"] == {"on_hand": CATALOG["sku-2"].initial_stock, "reserved": 0}
    saga = await shop.orders.sagas.get(OrderSaga, "o-cancel")
    assert saga is not None
    sent = [t.step for t in saga.history if t.kind == "compensation-sent"]
    assert len(sent) == len(set(sent))  # each compensation once
    # A completed order stays completed.
    assert (await client.place(_order("o-done", ("sku-1", 1)), wait=10))[1]["status"] == "completed"
    assert (await client.cancel("o-done"))[0] == 409


async def test_a_publisher_only_process_can_abort_an_order(
    shop: together.Shop, broker_url: str
) -> None:
    """An App without handlers only publishes (a back office, an importer): here it cancels
    an order on the shop's broker before the order is even placed. The saga keeps the abort
    (inputs in any order) and ends the order at its start: compensated, nothing done."""
    async with App("shop-backoffice", broker=broker_url) as backoffice:
        await backoffice.publish(OrderCancelled(order_id="o-backoffice"), key="o-backoffice")
    await _settle(shop)
    assert (await shop.client.place(_order("o-backoffice", ("sku-1", 1))))[0] == 202
    await _settle(shop)
    _, body = await shop.client.get("o-backoffice")
    assert (body["status"], body["step"]) == ("compensated", None)
    _, stock = await shop.client.stock()
    assert stock["sku-1"] == {"on_hand": CATALOG["sku-1"].initial_stock, "reserved": 0}


async def test_a_release_that_arrives_before_its_reserve_cancels_it(
    shop: together.Shop,
) -> None:
    """The inventory handles the saga's reserve and its release in one group with dedup on:
    a release that overtakes its reserve (an abort or a timeout while the reserve waited in
    a queue) cancels the reserve, which is skipped when it comes: nothing stays held."""
    reserve = ReserveStock(order_id="o-overtaken", lines=[{"sku": "sku-3", "qty": 4}])
    command = await shop.orders.publish(reserve, key="o-overtaken", topic="shop.stock.nowhere")
    release = ReleaseStock(order_id="o-overtaken", lines=[{"sku": "sku-3", "qty": 4}])
    await shop.orders.publish(
        release, key="o-overtaken", headers={COMPENSATES_HEADER: command.id}
    )  # the release first...
    await _settle(shop)
    await shop.orders.publish(command)  # ...then the reserve itself, on its topic
    await _settle(shop)
    stats = shop.inventory.stats()
    assert sum(s.get("cancels", 0) for s in stats.values()) == 1
    assert sum(s.get("cancelled", 0) for s in stats.values()) == 1
    _, stock = await shop.client.stock()
    assert stock["sku-3"] == {"on_hand": CATALOG["sku-3"].initial_stock, "reserved": 0}


async def test_a_late_shipment_is_retried_and_ships_once(tmp_path: Path, broker_url: str) -> None:
    # Every shipment late: twice the saga's ship timeout (SHOP_SHIP_TIMEOUT, 1 s).
    config = _config(tmp_path, broker_url, ship_late=1.0)
    late_id = "o-late"
    assert shipping.is_late(late_id, config.ship_late)
    async with together.running(config, http=True) as shop:
        status, body = await shop.client.place(_order(late_id, ("sku-1", 1)), wait=10)
        assert (status, body["status"]) == (200, "completed")
        await _settle(shop)
        saga = await shop.orders.sagas.get(OrderSaga, late_id)
        assert saga is not None
        assert [t.kind for t in saga.history if t.step == "ship"][:3] == [
            "command-sent",
            "timed-out",
            "retry-scheduled",
        ]
        shipments = [r async for r in shop.shipping.store.read_stream(f"shipment-{late_id}")]
        assert len(shipments) == 1
        _, stock = await shop.client.stock()
        assert stock["sku-1"]["on_hand"] == CATALOG["sku-1"].initial_stock - 1


class _LostAnswers:
    """Each order's first charge goes through at the provider, and its answer is lost (as
    when a connection drops): payments sees a failure and retries."""

    def __init__(self, inner: payments.ProviderClient) -> None:
        self.inner = inner
        self.keys: dict[str, list[str]] = {}  # order id -> the idempotency key of each call

    async def charge(self, key: str, order_id: str, amount_cents: int) -> str:
        calls = self.keys.setdefault(order_id, [])
        calls.append(key)
        charge_id = await self.inner.charge(key, order_id, amount_cents)
        if len(calls) == 1:
            raise payments.ProviderDown("connection lost before the answer")
        return charge_id

    async def refund(self, order_id: str, charge_id: str | None) -> None:
        await self.inner.refund(order_id, charge_id)


async def test_a_retried_charge_never_charges_twice(tmp_path: Path, broker_url: str) -> None:
    """The provider charged, the answer was lost, payments retried: with ctx.idempotency_key
    the retry gets the first charge back, so each order is charged once."""
    lost: list[_LostAnswers] = []

    def losing(inner: payments.ProviderClient) -> payments.ProviderClient:
        lost.append(_LostAnswers(inner))
        return lost[-1]

    config = _config(tmp_path, broker_url, provider_flaky=0.0)
    async with together.running(config, http=True, wrap_provider=losing) as shop:
        for i in range(5):
            await shop.client.place(_order(f"o-lost-{i}", ("sku-5", 1)))
        await _settle(shop)
        _, listed = await shop.client.orders()
        assert [o["status"] for o in listed["orders"]] == ["completed"] * 5
        _, charges = await shop.client.charges()
        charged = sorted(c["order_id"] for c in charges["charges"])
        assert charged == [f"o-lost-{i}" for i in range(5)]  # one charge (one key) per order
        calls = lost[0].keys
        assert all(len(keys) == 2 and keys[0] == keys[1] for keys in calls.values()), calls


class _Outage:
    """The provider down for its first ``calls`` calls (connection refused), then back."""

    def __init__(self, inner: payments.ProviderClient, calls: int) -> None:
        self.inner, self.left, self.refused = inner, calls, 0

    async def charge(self, key: str, order_id: str, amount_cents: int) -> str:
        if self.left > 0:
            self.left -= 1
            self.refused += 1
            raise payments.ProviderDown("connection refused")
        return await self.inner.charge(key, order_id, amount_cents)

    async def refund(self, order_id: str, charge_id: str | None) -> None:
        await self.inner.refund(order_id, charge_id)


async def test_a_provider_outage_opens_the_breaker_and_loses_nothing(
    tmp_path: Path, broker_url: str
) -> None:
    """25 refused calls: past 20 in 10 s the breaker opens, the charges wait in the broker
    (given back without spending attempts), a probe after 1 s finds the provider back, and
    every order completes; nothing is dead-lettered."""
    outages: list[_Outage] = []

    def down(inner: payments.ProviderClient) -> payments.ProviderClient:
        outages.append(_Outage(inner, calls=25))
        return outages[-1]

    config = _config(tmp_path, broker_url, provider_flaky=0.0)
    async with together.running(config, http=True, wrap_provider=down) as shop:
        for i in range(6):
            await shop.client.place(_order(f"o-outage-{i}", ("sku-5", 1)))
        await shop.orders.wait_idle(timeout=20)
        await _settle(shop)
        _, listed = await shop.client.orders()
        assert [o["status"] for o in listed["orders"]] == ["completed"] * 6
        stats = shop.payments.stats()
        assert outages[0].refused == 25
        assert sum(s.get("limited", 0) for s in stats.values()) > 0  # the breaker held some back
        assert await shop.payments.dead_letters.list() == []


async def test_the_route_functions_without_http(tmp_path: Path, broker_url: str) -> None:
    async with together.running(_config(tmp_path, broker_url), http=False) as shop:
        assert isinstance(shop.client, together.DirectClient)
        status, body = await shop.client.place(_order("o-direct", ("sku-1", 1)), wait=10)
        assert (status, body["status"]) == (200, "completed")
        assert (await shop.client.place({"customer": "c", "lines": []}))[0] == 422
