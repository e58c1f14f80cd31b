"""``eventflow demo``: two services, a few hundred orders, a summary and invariant checks.

An order service and an inventory service (two ``App``s) run in one process on the
``memory://`` broker with a SQLite store. Orders flow ``demo.order.placed`` -> inventory
reserves stock (``demo.stock.reserved`` or ``demo.stock.rejected``) -> the order service
confirms or rejects the order. Some orders are published twice (dedup must skip the copy),
some fail their first attempt (retried with backoff), and one poison message of garbage
bytes must end in the dead-letter queue. The command exits 0 only if every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..app import App
from ..ports import DeadLetter
from ._common import EXIT_FAILURE, EXIT_USAGE, CliError, configure_logging
from ._demo_services import InventoryService, OrderPlaced, OrderService

__all__ = ["Check", "DemoResult", "check", "command", "report", "run_demo"]

SKUS = ("sku-apple", "sku-pear", "sku-plum", "sku-fig", "sku-kiwi")
DUPLICATE_EVERY = 10
"""Every 10th order is published a second time with the same envelope id."""
POISON = b"\x00\xff{this is not an envelope"
_POLL = 0.02


@dataclass
class DemoResult:
    """What one demo run did, for the summary and the checks."""

    db_url: str
    orders: int
    duplicates_sent: int
    poison_sent: int
    inventory: InventoryService
    order_service: OrderService
    stats: dict[str, int]
    dead_letters: list[DeadLetter] = field(default_factory=list)
    elapsed: float = 0.0
    timed_out: bool = False


@dataclass(frozen=True, slots=True)
class Check:
    """One invariant: its description, whether it held, and what was seen."""

    name: str
    ok: bool
    detail: str


def _totals(*apps: App) -> dict[str, int]:
    totals: dict[str, int] = {}
    for app in apps:
        for name, counters in app.stats().items():
            prefix = "orders" if name.startswith("demo-orders") else "inventory"
            for k, v in counters.items():
                totals[f"{prefix}.{k}"] = totals.get(f"{prefix}.{k}", 0) + v
    return totals


async def run_demo(
    orders: int, db_path: str, *, seed: int = 7, timeout: float = 60.0
) -> DemoResult:
    """Run both services, place ``orders`` orders and wait until they are all settled.

    ``db_path`` is the SQLite file of both apps' store (an absolute path).
    """
    rng = random.Random(seed)
    per_sku = max(1, round(orders * 0.3))  # about 3 in 4 orders can be served
    inventory = InventoryService({sku: per_sku for sku in SKUS})
    order_service = OrderService()
    url = f"sqlite:///{db_path}"
    orders_app = App(
        "demo-orders", broker="memory://", store=url, handlers=order_service.handlers()
    )
    inventory_app = App(
        "demo-inventory", broker="memory://", store=url, handlers=inventory.handlers()
    )
    result = DemoResult(url, orders, 0, 0, inventory, order_service, {})
    started_at = datetime.now(UTC)
    async with inventory_app, orders_app:
        start = time.perf_counter()
        for i in range(1, orders + 1):
            order_id = f"o-{i:05d}"
            placed = OrderPlaced(order_id=order_id, sku=rng.choice(SKUS), qty=rng.randint(1, 3))
            env = await orders_app.publish(placed, key=order_id)
            if i % DUPLICATE_EVERY == 0:  # a producer retry: same envelope, same id
                await orders_app.publish(env)
                result.duplicates_sent += 1
            if i == (orders + 1) // 2:
                await orders_app.broker.publish("demo.order.placed", POISON)
                result.poison_sent += 1
        expected = orders + result.duplicates_sent + result.poison_sent
        deadline = start + timeout
        while True:
            stats = _totals(orders_app, inventory_app)
            settled = sum(
                stats.get(f"inventory.{k}", 0) for k in ("handled", "duplicates", "dead_lettered")
            )
            if settled >= expected and stats.get("orders.handled", 0) >= orders:
                break
            if time.perf_counter() > deadline:
                result.timed_out = True
                break
            await asyncio.sleep(_POLL)
        result.elapsed = time.perf_counter() - start
        result.stats = _totals(orders_app, inventory_app)
        letters = await inventory_app.dead_letters.list(limit=10_000)
        result.dead_letters = [d for d in letters if d.failed_at >= started_at]
    return result


def check(result: DemoResult) -> list[Check]:
    """Verify the demo's invariants."""
    inv, svc, n = result.inventory, result.order_service, result.orders
    stats = result.stats
    order_ids = [f"o-{i:05d}" for i in range(1, n + 1)]
    once = [o for o in order_ids if len(svc.outcomes.get(o, ())) == 1]
    handled_once = [o for o in order_ids if inv.handled.get(o) == 1]
    skipped = stats.get("inventory.duplicates", 0)
    final = sum(inv.stock.values())
    conserved = sum(inv.initial.values()) - final == inv.reserved_units
    letters = result.dead_letters
    reasons = ", ".join(d.reason for d in letters) or "none"
    return [
        Check(
            "all messages processed in time",
            not result.timed_out,
            f"{result.elapsed:.2f}s" + (" (timed out)" if result.timed_out else ""),
        ),
        Check(
            "every order resolved exactly once",
            len(once) == n and len(svc.outcomes) == n,
            f"{len(once)}/{n} orders with exactly one outcome, {len(svc.outcomes)} resolved",
        ),
        Check(
            "duplicates handled once (dedup)",
            len(handled_once) == n and skipped == result.duplicates_sent,
            f"{len(handled_once)}/{n} orders reserved once, "
            f"{skipped}/{result.duplicates_sent} duplicates skipped",
        ),
        Check(
            "reservations match confirmations",
            inv.reserved == svc.count("confirmed") and inv.rejected == svc.count("rejected"),
            f"{inv.reserved} reserved / {svc.count('confirmed')} confirmed, "
            f"{inv.rejected} rejected / {svc.count('rejected')} rejected",
        ),
        Check(
            "stock never negative",
            inv.lowest >= 0 and min(inv.stock.values(), default=0) >= 0 and conserved,
            f"lowest level {inv.lowest}, {inv.reserved_units} units reserved, {final} left",
        ),
        Check(
            "exactly one dead letter (the poison message)",
            len(letters) == 1 and letters[0].reason == "malformed",
            f"{len(letters)} dead letter(s): {reasons}",
        ),
    ]


def report(result: DemoResult) -> str:
    """The summary of a run, as printed by ``eventflow demo``."""
    inv, svc, stats = result.inventory, result.order_service, result.stats
    elapsed = max(result.elapsed, 1e-9)
    retries = stats.get("inventory.retries", 0) + stats.get("orders.retries", 0)
    messages = sum(stats.get(f"{p}.received", 0) for p in ("orders", "inventory"))
    rows = [
        ("orders placed", f"{result.orders}"),
        (
            "duplicates sent",
            f"{result.duplicates_sent} (skipped by dedup: {stats.get('inventory.duplicates', 0)})",
        ),
        ("poison messages", f"{result.poison_sent} (garbage bytes on demo.order.placed)"),
        ("stock reserved", f"{inv.reserved} orders, {inv.reserved_units} units"),
        ("stock rejected", f"{inv.rejected} orders (out of stock)"),
        ("orders confirmed", f"{svc.count('confirmed')}"),
        ("orders rejected", f"{svc.count('rejected')}"),
        ("handler retries", str(retries)),
        ("dead letters", f"{len(result.dead_letters)}"),
    ]
    lines = [
        "eventflow demo: order service + inventory service, memory:// broker, "
        f"store {result.db_url}",
        "",
    ]
    lines += [f"  {name:<18}{value}" for name, value in rows]
    for letter in result.dead_letters:
        error = letter.error.strip().splitlines()[0] if letter.error.strip() else ""
        lines.append(f"  {'':<18}[{letter.group}] {letter.reason}: {error}")
    lines.append(
        f"  {'elapsed':<18}{result.elapsed:.2f} s ({result.orders / elapsed:,.0f} orders/s, "
        f"{messages / elapsed:,.0f} messages/s)"
    )
    return "\n".join(lines)


def command(args: argparse.Namespace) -> int:
    """Run the demo from the command line; exit 0 only if every check holds."""
    configure_logging(args.log_level)
    if args.orders < 1:
        raise CliError(f"--orders must be at least 1, got {args.orders}", EXIT_USAGE)
    if args.db:
        directory = os.path.dirname(os.path.abspath(args.db))
        if not os.path.isdir(directory):
            raise CliError(f"--db: directory {directory!r} does not exist", EXIT_USAGE)
        path = os.path.abspath(args.db)
        result = asyncio.run(run_demo(args.orders, path, seed=args.seed, timeout=args.timeout))
    else:
        with tempfile.TemporaryDirectory(prefix="eventflow-demo-") as tmp:
            path = os.path.join(tmp, "demo.db")
            result = asyncio.run(run_demo(args.orders, path, seed=args.seed, timeout=args.timeout))
    print(report(result))
    checks = check(result)
    print("\nchecks")
    for c in checks:
        print(f"  {'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    failed = [c for c in checks if not c.ok]
    if failed:
        print(f"\n{len(failed)} check(s) failed: {', '.join(c.name for c in failed)}")
        return EXIT_FAILURE
    print("\nall checks passed")
    if args.db:
        print(f"inspect the store: eventflow dlq list --store {result.db_url}")
    return 0
