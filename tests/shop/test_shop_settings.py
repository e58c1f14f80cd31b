"""examples/shop/settings.py: configuration from the environment, one store per service."""

from __future__ import annotations

import pytest

from eventflow import ConfigurationError
from examples.shop.settings import from_env, store_url


def test_defaults_are_the_embedded_form() -> None:
    config = from_env({})
    assert (config.broker, config.store) == ("memory://", "sqlite:///shop.db")
    assert (config.orders_port, config.inventory_port, config.provider_port) == (8000, 8001, 8002)
    assert config.provider_url == "http://127.0.0.1:8002"
    assert config.decline_above_cents == 50_000
    assert (config.provider_flaky, config.ship_delay, config.ship_late) == (0.1, 0.05, 0.05)
    assert config.store_for("orders") == "sqlite:///shop-orders.db"


def test_the_environment_overrides() -> None:
    config = from_env(
        {
            "SHOP_BROKER": "nats://127.0.0.1:4222",
            "SHOP_PROVIDER_PORT": "9002",
            "SHOP_DECLINE_ABOVE": "99.99",
            "SHOP_SHIP_LATE": "0",
        }
    )
    assert config.broker == "nats://127.0.0.1:4222"
    assert config.provider_url == "http://127.0.0.1:9002"
    assert (config.decline_above_cents, config.ship_late) == (9_999, 0.0)
    with pytest.raises(ConfigurationError, match=r"SHOP_SHIP_LATE=2\.0 is a share"):
        from_env({"SHOP_SHIP_LATE": "2"})
    with pytest.raises(ConfigurationError, match="SHOP_SHIP_DELAY='soon' is not a number"):
        from_env({"SHOP_SHIP_DELAY": "soon"})


def test_each_service_has_its_own_store() -> None:
    assert (
        store_url("sqlite:////var/shop/shop.db", "payments")
        == "sqlite:////var/shop/shop-payments.db"
    )
    assert store_url("sqlite:///data", "shipping") == "sqlite:///data-shipping"
    pg = "postgresql://postgres@127.0.0.1/test"
    assert store_url(pg, "inventory") == f"{pg}?schema=shop_inventory"
    assert store_url(f"{pg}?connect_timeout=5", "provider") == (
        f"{pg}?connect_timeout=5&schema=shop_provider"
    )
    shared = f"{pg}?schema=shop"
    assert store_url(shared, "orders") == shared  # a schema named: every service shares it
    with pytest.raises(ConfigurationError, match="keeps its tables in SQL"):
        store_url("memory://", "orders")
