"""``eventflow demo``: the shop (``examples/shop``) in one process, a few hundred orders, a
summary, one compensated order's causal tree, and the invariant checks.

The four services (orders with its saga, inventory, payments, shipping) and the fake payment
provider run in this process on the embedded default (``memory://`` broker, one SQLite file
per service in a temporary directory), or on ``--broker``/``--store``. Orders are placed
through the HTTP API in-process (``httpx.ASGITransport``); without FastAPI installed, through
the functions its routes call. Some orders are posted twice, some are declined (above the
payments limit), some ask more than the stock, some are cancelled right after they were
placed, some are shipped too late (the saga retries the ship step), and one poison message of
garbage bytes is published. The command exits 0 only when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from ._common import EXIT_FAILURE, EXIT_USAGE, CliError, configure_logging
from ._demo_run import DemoResult, Planned, run_demo
from ._draw import terminal, terminal_table

__all__ = ["Check", "check", "command", "report"]

NO_HTTP = (
    "FastAPI/httpx are not installed: the demo calls the functions the HTTP routes call "
    "(pip install 'eventflow[fastapi]' httpx to go through the HTTP API)"
)


@dataclass(frozen=True, slots=True)
class Check:
    """One invariant: its description, whether it held, and what was seen."""

    name: str
    ok: bool
    detail: str


def check(result: DemoResult) -> list[Check]:
    """Verify the demo's invariants."""
    from examples.shop.catalog import CATALOG

    planned, final = result.planned, result.final

    def expected(p: Planned) -> str:
        # A cancellation that reached the saga after its pivot is ignored (the saga's
        # history says so): the order completes, as a cancel after the end would.
        return "completed" if p.order_id in result.aborts_ignored else p.expected

    wrong = [
        f"{p.order_id} {final.get(p.order_id, {}).get('status', 'missing')} ({p.kind})"
        for p in planned
        if final.get(p.order_id, {}).get("status") != expected(p)
    ]
    completed = {
        p.order_id for p in planned if final.get(p.order_id, {}).get("status") == "completed"
    }
    compensated = {p.order_id for p in planned} - completed
    sold: Counter[str] = Counter()
    for p in planned:
        if p.order_id in completed:
            for line in p.body["lines"]:
                sold[line["sku"]] += line["qty"]
    level_errors = []
    for sku in CATALOG:
        before = result.stock_before.get(sku, {"on_hand": 0, "reserved": 0})
        after = result.stock_after.get(sku, {"on_hand": 0, "reserved": 0})
        if after["on_hand"] != before["on_hand"] - sold[sku] or after["reserved"] != 0:
            level_errors.append(f"{sku}: {before} -> {after}, {sold[sku]} sold")
    lowest = min(result.lowest_available.values(), default=0)
    unrefunded = Counter(c["order_id"] for c in result.charges if not c["refunded"])
    keys = Counter(c["order_id"] for c in result.charges)
    charge_errors = [o for o in completed if unrefunded[o] != 1 or keys[o] != 1] + [
        o for o in compensated if unrefunded[o]
    ]
    ship_errors = [o for o in completed if result.shipments[o] != 1] + [
        o for o in compensated if result.shipments[o]
    ]
    twice = [f"{o}/{sku}" for (o, sku), n in result.releases.items() if n > 1]
    freed_unheld = [f"{o}/{sku}" for (o, sku) in result.releases if (o, sku) not in result.holds]
    held_left = [
        o
        for o in compensated
        if any(result.holds[(o, s)] != result.releases[(o, s)] for s in CATALOG)
    ]
    letters = result.dead_letters
    reasons = ", ".join(f"{d.group}: {d.reason}" for d in letters) or "none"
    n = len(planned)
    return [
        Check(
            "every order ended in time",
            not result.timed_out and len(final) == n,
            f"{len(final)}/{n} orders listed, in {result.elapsed:.2f}s"
            + (" (timed out)" if result.timed_out else ""),
        ),
        Check(
            "every order ended as its input dictates (completed or compensated)",
            not wrong,
            f"{n - len(wrong)}/{n} as expected"
            + (f"; not: {', '.join(wrong[:5])}" if wrong else ""),
        ),
        Check(
            "one order and one saga per order id (duplicate posts)",
            result.sagas == n,
            f"{result.sagas} sagas for {n} orders, "
            f"{sum(p.duplicate for p in planned)} posted twice",
        ),
        Check(
            "stock never negative; on hand = before - sold, nothing left reserved",
            lowest >= 0 and not level_errors,
            f"lowest available {lowest}"
            + (f"; {'; '.join(level_errors)}" if level_errors else "; levels match"),
        ),
        Check(
            "each compensation once (nothing released twice or unheld, nothing left held)",
            not twice and not freed_unheld and not held_left and not result.compensations_twice,
            f"{sum(result.releases.values())} SKU lines released, "
            f"{sum(result.compensations.values())} compensations sent"
            + (f"; twice: {twice + result.compensations_twice}" if twice else "")
            + (f"; unheld: {freed_unheld}" if freed_unheld else "")
            + (f"; still held: {held_left}" if held_left else ""),
        ),
        Check(
            "completed orders charged once and shipped once; compensated ones neither",
            not charge_errors and not ship_errors,
            f"{sum(unrefunded.values())} charges kept, {sum(result.shipments.values())} shipments"
            + (
                f"; wrong: {(charge_errors + ship_errors)[:5]}"
                if charge_errors or ship_errors
                else ""
            ),
        ),
        Check(
            "exactly one dead letter (the poison message)",
            len(letters) == 1 and letters[0].reason == "malformed",
            f"{len(letters)} dead letter(s): {reasons}",
        ),
    ]


def _rows(result: DemoResult) -> list[list[str]]:
    planned, final = result.planned, result.final
    statuses = Counter(o["status"] for o in final.values())
    kinds = Counter(p.kind for p in planned)
    waited = [p for p in planned if p.wait]
    answered = sum(1 for p in waited if p.placed is not None and p.placed[0] == 200)
    stats = result.stats
    rows = [
        ["orders placed", str(len(planned))],
        ["posted twice", f"{sum(p.duplicate for p in planned)} (one order each)"],
        ["declined", f"{kinds['declined']} (above the payments limit)"],
        ["short of stock", f"{kinds['short']} (a line asks more than the shelf)"],
        ["cancelled", f"{kinds['cancelled']} (right after they were placed)"],
        ["?wait=10", f"{len(waited)} posts, {answered} answered 200 with the outcome"],
        ["shipped late", f"{result.late_shipments} (the saga timed ship out and retried)"],
    ]
    rows += [[f"final: {s}", str(statuses[s])] for s in ("completed", "compensated", "failed")]
    rows.append(["final: pending", str(statuses["pending"] + len(planned) - len(final))])
    comp = result.compensations
    rows.append(
        [
            "compensations run",
            f"{sum(comp.values())} ({comp['reserve']} release, {comp['charge']} refund; "
            f"{stats.get('cancelled', 0)} commands cancelled before they arrived)",
        ]
    )
    rows.append(["handler retries", f"{stats.get('retries', 0)} (provider 429/503, conflicts)"])
    rows.append(["dead letters", str(len(result.dead_letters))])
    rate = len(planned) / max(result.elapsed, 1e-9)
    rows.append(["elapsed", f"{result.elapsed:.2f} s ({rate:,.0f} orders/s)"])
    return rows


def report(result: DemoResult) -> str:
    """The summary of a run, as printed by ``eventflow demo``: a table (drawn with rich on a
    terminal, plain text otherwise), then the causal tree of one compensated order."""
    how = "the HTTP API in-process" if result.over_http else "the route functions (no FastAPI)"
    lines = [
        "eventflow demo: the shop (orders, inventory, payments, shipping) in one process, "
        f"broker {result.broker}, store {result.store}, orders placed through {how}",
        "",
    ]
    rows = _rows(result)
    if terminal():
        lines.append(terminal_table(["THE RUN", ""], rows))
    else:
        lines += [f"  {name:<20}{value}" for name, value in rows]
    for letter in result.dead_letters:
        error = letter.error.strip().splitlines()[0] if letter.error.strip() else ""
        lines.append(f"  {'':<20}[{letter.group}] {letter.reason}: {error}")
    if result.trace_of:
        lines += [
            "",
            f"the causal tree of compensated order {result.trace_of} (GET /orders/{{id}}/trace):",
        ]
        lines += result.trace
    return "\n".join(lines)


def _config(args: argparse.Namespace, directory: str) -> Any:
    from examples.shop.settings import settings

    return replace(
        settings,
        broker=args.broker or "memory://",
        store=args.store or f"sqlite:///{os.path.join(directory, 'shop.db')}",
    )


def command(args: argparse.Namespace) -> int:
    """Run the demo from the command line; exit 0 only if every check holds."""
    configure_logging(args.log_level)
    if args.orders < 1:
        raise CliError(f"--orders must be at least 1, got {args.orders}", EXIT_USAGE)
    try:
        from examples.shop import together
    except ImportError as exc:
        raise CliError(
            f"the demo runs examples/shop, which cannot be imported ({exc}): install eventflow "
            "from its repository (pip install -e .), which packages examples/",
            EXIT_FAILURE,
        ) from exc
    if not together.http_available():
        print(NO_HTTP)
    with tempfile.TemporaryDirectory(prefix="eventflow-demo-") as tmp:
        config = _config(args, tmp)
        result = asyncio.run(run_demo(config, args.orders, seed=args.seed, timeout=args.timeout))
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
    return 0
