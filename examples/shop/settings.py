"""The shop's configuration, from environment variables (and nothing else).

The defaults give the embedded one-process form: the ``memory://`` broker and one SQLite
file per service (``shop-orders.db``, ``shop-inventory.db``, ... in the current directory).

| variable | default | what |
| --- | --- | --- |
| ``SHOP_BROKER`` | ``memory://`` | the broker of every service (``nats://...``, ``kafka://...``) |
| ``SHOP_STORE`` | ``sqlite:///shop.db`` | the store; each service gets its own (below) |
| ``SHOP_ORDERS_PORT`` | 8000 | the orders HTTP API |
| ``SHOP_INVENTORY_PORT`` | 8001 | the inventory HTTP API (``GET /stock``) |
| ``SHOP_PROVIDER_PORT`` | 8002 | the fake payment provider |
| ``SHOP_PROVIDER_URL`` | ``http://127.0.0.1:$SHOP_PROVIDER_PORT`` | where payments calls it |
| ``SHOP_DECLINE_ABOVE`` | 500.00 | payments declines a charge above this amount |
| ``SHOP_PROVIDER_FLAKY`` | 0.1 | share of provider calls answered 429 or 503 |
| ``SHOP_PROVIDER_RETRY_AFTER`` | 1 | the provider's ``Retry-After`` (seconds) on a 429 |
| ``SHOP_SHIP_DELAY`` | 0.05 | seconds a shipment takes |
| ``SHOP_SHIP_LATE`` | 0.05 | share of shipments slower than the saga's ship timeout |
| ``SHOP_SHIP_TIMEOUT`` | 1.0 | the saga's ship step timeout (a late shipment takes 2 x) |
| ``SHOP_RESERVE_TIMEOUT`` | 30 | the saga's reserve step timeout |
| ``SHOP_CHARGE_TIMEOUT`` | 30 | the saga's charge step timeout |
| ``SHOP_REFUND_TIMEOUT`` | 30 | how long the saga waits for a refund's confirmation |
| ``SHOP_METRICS`` | on if ``prometheus-client`` is installed | ``/metrics`` on the HTTP APIs |

The order saga's step timeouts (``SHOP_*_TIMEOUT``) are read when ``orders.py`` is imported
(they are part of the saga class); the other settings can also be given to each service's
``create_app(config)``.

One store per service (docs/event-store.md recommends it once services are deployed on
their own): on PostgreSQL each service uses the schema ``shop_<service>`` of the database
``SHOP_STORE`` names, unless the URL names a schema already (then they share that one); on
SQLite each uses its own file next to the one named (``shop.db`` -> ``shop-orders.db``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from eventflow import ConfigurationError

__all__ = ["SERVICES", "Settings", "from_env", "settings", "store_url"]

SERVICES = ("orders", "inventory", "payments", "shipping", "provider")
"""The shop's services, each with a store of its own (the provider is the fake bank)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """The shop's configuration (see the module docstring for each variable)."""

    broker: str = "memory://"
    store: str = "sqlite:///shop.db"
    orders_port: int = 8000
    inventory_port: int = 8001
    provider_port: int = 8002
    provider_url: str = "http://127.0.0.1:8002"
    decline_above_cents: int = 50_000
    provider_flaky: float = 0.1
    provider_retry_after: float = 1.0
    ship_delay: float = 0.05
    ship_late: float = 0.05
    ship_timeout: float = 1.0
    reserve_timeout: float = 30.0
    charge_timeout: float = 30.0
    refund_timeout: float = 30.0
    metrics: bool = False

    def store_for(self, service: str) -> str:
        """The store URL of ``service`` (one of ``SERVICES``)."""
        return store_url(self.store, service)


def store_url(url: str, service: str) -> str:
    """The store of ``service`` derived from the shop's ``url``: its own PostgreSQL schema
    (``shop_<service>``) unless ``url`` names one, or its own SQLite file."""
    if service not in SERVICES:
        raise ConfigurationError(f"unknown shop service {service!r}: one of {SERVICES}")
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else parts.path
        stem, dot, ext = path.rpartition(".")
        own = f"{stem}-{service}.{ext}" if dot and "/" not in ext else f"{path}-{service}"
        return f"sqlite:///{own}"
    if parts.scheme in ("postgresql", "postgres"):
        query = parse_qsl(parts.query, keep_blank_values=True)
        if any(name == "schema" for name, _ in query):
            return url  # one schema named for every service: they share it
        query.append(("schema", f"shop_{service}"))
        return urlunsplit(parts._replace(query=urlencode(query)))
    raise ConfigurationError(
        f"SHOP_STORE={url!r}: the shop keeps its tables in SQL; use sqlite:///shop.db "
        "(the default) or postgresql://user@host/db"
    )


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not a number: unset it or give one") from None


def _share(env: Mapping[str, str], name: str, default: float) -> float:
    value = _number(env, name, default)
    if not 0.0 <= value <= 1.0:
        raise ConfigurationError(f"{name}={value} is a share: give a number from 0 to 1")
    return value


def from_env(env: Mapping[str, str] | None = None) -> Settings:
    """The settings from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    provider_port = int(_number(env, "SHOP_PROVIDER_PORT", 8002))
    decline = env.get("SHOP_DECLINE_ABOVE") or "500.00"
    try:
        decline_cents = int(Decimal(decline) * 100)
    except ArithmeticError:
        raise ConfigurationError(
            f"SHOP_DECLINE_ABOVE={decline!r} is not an amount: give one such as 500.00"
        ) from None
    metrics_default = importlib.util.find_spec("prometheus_client") is not None
    metrics = env.get("SHOP_METRICS")
    return Settings(
        broker=env.get("SHOP_BROKER") or "memory://",
        store=env.get("SHOP_STORE") or "sqlite:///shop.db",
        orders_port=int(_number(env, "SHOP_ORDERS_PORT", 8000)),
        inventory_port=int(_number(env, "SHOP_INVENTORY_PORT", 8001)),
        provider_port=provider_port,
        provider_url=env.get("SHOP_PROVIDER_URL") or f"http://127.0.0.1:{provider_port}",
        decline_above_cents=decline_cents,
        provider_flaky=_share(env, "SHOP_PROVIDER_FLAKY", 0.1),
        provider_retry_after=_number(env, "SHOP_PROVIDER_RETRY_AFTER", 1.0),
        ship_delay=_number(env, "SHOP_SHIP_DELAY", 0.05),
        ship_late=_share(env, "SHOP_SHIP_LATE", 0.05),
        ship_timeout=_number(env, "SHOP_SHIP_TIMEOUT", 1.0),
        reserve_timeout=_number(env, "SHOP_RESERVE_TIMEOUT", 30.0),
        charge_timeout=_number(env, "SHOP_CHARGE_TIMEOUT", 30.0),
        refund_timeout=_number(env, "SHOP_REFUND_TIMEOUT", 30.0),
        metrics=metrics_default if metrics in (None, "") else metrics not in ("0", "false", "no"),
    )


settings = from_env()
"""The settings of this process, read once at import."""
