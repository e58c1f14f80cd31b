"""``python -m examples.shop.load``: orders at a fixed rate, timed from POST to final status.

Against a running shop (``python -m examples.shop`` in another terminal)::

    python -m examples.shop.load --rate 200 --duration 30
    python -m examples.shop.load --rate 50 --duration 10 --url http://127.0.0.1:8000 --json

It sends ``rate * duration`` orders (``POST /orders``), one every ``1/rate`` seconds, and
never more than ``--in-flight`` at once nor past ``duration`` plus a tenth: bounded in
count and in time. Each POST asks ``?wait=W`` (``--wait``), so the orders service
answers with the final body when the saga ends within W seconds: the time from sending the
POST to that answer is the order's completion time. An order still pending then (202) is
polled until it is final, its time taken when a poll first sees it final (so within a
poll round of the truth): every 0.2 s with ``GET /orders/{id}``, or, while more than 40
are pending (a backlog), every second with one ``GET /orders?status=pending`` and a
``GET /orders/{id}`` of those of ours it no longer lists, so that polling a backlog does
not cost the service one request per pending order. ``--wait 0`` polls every order.
Once sending is over, polling goes on while the shop makes progress: an accepted order
still not final when no order has become final for ``--settle`` seconds (60), or
``--max-settle`` seconds (900) after the last POST, is lost. (A backlog that drains
slowly is not loss; an order the shop stopped working on is.)

The report: orders sent, accepted (202/200) and refused (with why), accepted orders per
second over the sending window, final orders per status, p50/p95/p99 completion time, and
the lost orders by id. The exit code is 1 when an order was lost or refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

__all__ = ["FINAL", "LoadResult", "main", "order_body", "percentile", "run_load"]

FINAL = frozenset({"completed", "compensated", "failed"})
"""Order statuses that do not change any more."""
POLL_INTERVAL = 0.2
"""Seconds between two polls of a pending order."""
POLLERS = 8
"""Pending orders polled at once (the polls compete with the orders for the service)."""
LIST_ABOVE = 40
"""With more orders pending than this (a backlog), a poll round lists the pending orders
(``GET /orders?status=pending``) and asks only for those of ours it no longer lists."""
LIST_INTERVAL = 1.0
"""Seconds between two poll rounds that list the pending orders."""
PROBES = 200
"""The most orders a listing round asks for one by one (the oldest first)."""


def percentile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile (``share`` in 0..1) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(share * len(ordered)))
    return ordered[rank - 1]


def order_body(
    order_id: str, rng: random.Random, skus: Sequence[str], weights: Sequence[int] | None = None
) -> dict[str, object]:
    """A small order: one or two lines of one unit each (below the default decline limit),
    SKUs drawn in proportion to ``weights`` (their initial stock, so that no SKU runs out
    long before the others)."""
    want = min(len(skus), rng.choice((1, 1, 2)))
    lines: list[str] = []
    while len(lines) < want:
        sku = rng.choices(list(skus), weights=weights)[0]
        if sku not in lines:
            lines.append(sku)
    return {
        "order_id": order_id,
        "customer": f"c-{rng.randrange(1000)}",
        "lines": [{"sku": sku, "qty": 1} for sku in lines],
    }


def catalog_stock() -> dict[str, int]:
    """The SKUs of ``examples/shop/catalog.py`` and their initial stock."""
    from .catalog import CATALOG

    return {sku: item.initial_stock for sku, item in CATALOG.items()}


@dataclass
class LoadResult:
    """What one run measured (times in seconds)."""

    rate: float
    duration: float
    planned: int = 0
    sent: int = 0
    accepted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    by_status: dict[str, list[float]] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    send_window: float = 0.0
    finish_window: float = 0.0
    behind: float = 0.0
    peak_in_flight: int = 0

    @property
    def accepted_per_s(self) -> float:
        """Accepted orders per second over the sending window."""
        return self.accepted / self.send_window if self.send_window > 0 else math.nan

    @property
    def final_per_s(self) -> float:
        """Orders that reached a final status per second, from the first POST to the last
        final status seen."""
        final = sum(self.statuses.values())
        return final / self.finish_window if self.finish_window > 0 else math.nan

    def as_dict(self) -> dict[str, object]:
        """The result for ``--json`` (times in milliseconds)."""
        return {
            "target_rate": self.rate,
            "duration_s": self.duration,
            "planned": self.planned,
            "sent": self.sent,
            "accepted": self.accepted,
            "refused": dict(self.refused),
            "accepted_per_s": round(self.accepted_per_s, 1),
            "final_per_s": round(self.final_per_s, 1),
            "statuses": dict(self.statuses),
            "p50_ms": _ms(percentile(self.latencies, 0.50)),
            "p95_ms": _ms(percentile(self.latencies, 0.95)),
            "p99_ms": _ms(percentile(self.latencies, 0.99)),
            "max_ms": _ms(max(self.latencies, default=math.nan)),
            "by_status_ms": {
                status: {
                    "p50": _ms(percentile(times, 0.50)),
                    "p99": _ms(percentile(times, 0.99)),
                }
                for status, times in sorted(self.by_status.items())
            },
            "lost": self.lost,
            "most_behind_schedule_ms": _ms(self.behind),
            "peak_in_flight": self.peak_in_flight,
        }


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1000, 1)


class _Run:
    """One load run's state: the orders pending, what was seen, the schedule."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        result: LoadResult,
        *,
        wait: float,
        in_flight: int,
        on_change: Callable[[LoadResult, int], None],
    ) -> None:
        self.client = client
        self.result = result
        self.wait = wait
        self.slots = asyncio.Semaphore(in_flight)
        self.in_flight = 0
        self.pending: dict[str, float] = {}  # order id -> when its POST was sent
        self.sending_done = asyncio.Event()
        self.on_change = on_change
        self.started = 0.0
        self.last_final = 0.0

    def _final(self, order_id: str, status: str, sent_at: float) -> None:
        now = time.monotonic()
        self.result.statuses[status] += 1
        self.result.latencies.append(now - sent_at)
        self.result.by_status.setdefault(status, []).append(now - sent_at)
        self.last_final = now
        self.pending.pop(order_id, None)
        self.on_change(self.result, len(self.pending))

    async def post(self, body: dict[str, object]) -> None:
        order_id = str(body["order_id"])
        try:
            sent_at = time.monotonic()
            params = {"wait": f"{self.wait:g}"} if self.wait > 0 else {}
            try:
                answer = await self.client.post(
                    "/orders", json=body, params=params, timeout=self.wait + 30.0
                )
            except httpx.HTTPError as exc:
                self.result.refused[type(exc).__name__] += 1
                return
            if answer.status_code not in (200, 202):
                self.result.refused[f"HTTP {answer.status_code}"] += 1
                return
            self.result.accepted += 1
            status = str(answer.json().get("status", "pending"))
            if status in FINAL:
                self._final(order_id, status, sent_at)
            else:
                self.pending[order_id] = sent_at
        finally:
            self.in_flight -= 1
            self.slots.release()
            self.on_change(self.result, len(self.pending))

    async def send_all(self, bodies: list[dict[str, object]], rate: float, until: float) -> None:
        """Send ``bodies`` one every ``1/rate`` s (none after ``until``), each in a slot."""
        self.started = time.monotonic()
        try:
            async with asyncio.TaskGroup() as tg:
                for i, body in enumerate(bodies):
                    due = self.started + i / rate
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await self.slots.acquire()
                    now = time.monotonic()
                    if now > until:
                        self.slots.release()
                        break
                    self.result.behind = max(self.result.behind, now - due)
                    self.in_flight += 1
                    self.result.peak_in_flight = max(self.result.peak_in_flight, self.in_flight)
                    self.result.sent += 1
                    tg.create_task(self.post(body))
                self.result.send_window = max(time.monotonic() - self.started, 1.0 / rate)
        finally:
            self.sending_done.set()

    async def poll(self, settle: float, max_settle: float) -> None:
        """Poll pending orders until none is left once sending is over, or no order has
        become final for ``settle`` seconds, or ``max_settle`` seconds have passed since
        sending ended: those left are lost."""
        cap = ended = math.inf
        while True:
            if self.sending_done.is_set():
                now = time.monotonic()
                if cap == math.inf:
                    ended, cap = now, now + max_settle
                stalled = now - max(self.last_final, ended) > settle
                if not self.pending or stalled or now > cap:
                    break
            listing = len(self.pending) > LIST_ABOVE
            await self._poll_round()
            await asyncio.sleep(LIST_INTERVAL if listing else POLL_INTERVAL)
        self.result.lost = sorted(self.pending)

    async def _poll_round(self) -> None:
        if len(self.pending) > LIST_ABOVE:
            await self._poll_lists()
        else:
            await self._ask(list(self.pending.items()))

    async def _ask(self, orders: list[tuple[str, float]]) -> None:
        """``GET /orders/{id}`` of each of ``orders`` (order id, when sent), a few at once."""
        gate = asyncio.Semaphore(POLLERS)

        async def one(order_id: str, sent_at: float) -> None:
            async with gate:
                try:
                    answer = await self.client.get(f"/orders/{order_id}", timeout=10.0)
                except httpx.HTTPError:
                    return  # asked again next round
                if answer.status_code == 200:
                    status = str(answer.json().get("status"))
                    if status in FINAL and order_id in self.pending:
                        self._final(order_id, status, sent_at)

        async with asyncio.TaskGroup() as tg:
            for order_id, sent_at in orders:
                tg.create_task(one(order_id, sent_at))

    async def _poll_lists(self) -> None:
        """A backlog: one ``GET /orders?status=pending``; the orders of ours it no longer
        lists (the oldest :data:`PROBES` of them) are asked for one by one: final, or not
        yet in the service's list of orders (its projection lags)."""
        try:
            answer = await self.client.get("/orders", params={"status": "pending"}, timeout=60.0)
        except httpx.HTTPError:
            return  # asked again next round
        if answer.status_code != 200:
            return
        still = {str(order.get("order_id")) for order in answer.json().get("orders", [])}
        oldest = sorted(self.pending.items(), key=lambda item: item[1])
        await self._ask([(o, t) for o, t in oldest if o not in still][:PROBES])


async def run_load(
    url: str,
    *,
    rate: float,
    duration: float,
    wait: float = 5.0,
    settle: float = 60.0,
    max_settle: float = 900.0,
    in_flight: int = 2000,
    skus: Sequence[str] | None = None,
    seed: int | None = None,
    on_change: Callable[[LoadResult, int], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> LoadResult:
    """Place ``rate * duration`` orders at ``rate`` per second against the orders service
    at ``url`` and follow each to its final status (module docstring). ``on_change(result,
    pending)`` is called as answers arrive (the progress bar)."""
    if rate <= 0 or duration <= 0:
        raise ValueError("--rate and --duration must be positive")
    rng = random.Random(seed)
    run_id = (
        uuid.UUID(int=rng.getrandbits(128)).hex[:8] if seed is not None else uuid.uuid4().hex[:8]
    )
    stock = dict.fromkeys(skus, 1) if skus is not None else catalog_stock()
    choices, weights = list(stock), list(stock.values())
    count = max(1, int(rate * duration))
    bodies = [order_body(f"load-{run_id}-{i}", rng, choices, weights) for i in range(count)]
    result = LoadResult(rate=rate, duration=duration, planned=count)
    limits = httpx.Limits(max_connections=in_flight + POLLERS, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, limits=limits, transport=transport) as client:
        run = _Run(client, result, wait=wait, in_flight=in_flight, on_change=on_change or _quiet)
        until = time.monotonic() + duration + max(1.0, 0.1 * duration)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(run.send_all(bodies, rate, until))
            tg.create_task(run.poll(settle, max_settle))
    result.finish_window = max(run.last_final - run.started, 0.0)
    return result


def _quiet(result: LoadResult, pending: int) -> None:
    """No progress display."""


def _report(result: LoadResult) -> str:
    data = result.as_dict()
    refused = ", ".join(f"{k}: {v}" for k, v in result.refused.items()) or "none"
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(result.statuses.items())) or "none"
    lost = f"{len(result.lost)}" + (f" ({', '.join(result.lost[:10])} ...)" if result.lost else "")
    rows = [
        ("target", f"{result.rate:g} orders/s for {result.duration:g} s"),
        (
            "sent",
            f"{result.sent} of {result.planned}, at most {data['most_behind_schedule_ms']} ms "
            f"behind schedule, at most {result.peak_in_flight} unanswered"
            + (
                ""
                if result.sent == result.planned
                else " (the rest not sent within the time bound: too many POSTs unanswered, or "
                "this process could not keep the schedule)"
            ),
        ),
        ("accepted", f"{result.accepted}, refused: {refused}"),
        ("accepted/s", f"{data['accepted_per_s']} over {result.send_window:.1f} s"),
        ("final/s", f"{data['final_per_s']} over {result.finish_window:.1f} s"),
        ("final", statuses),
        (
            "POST to final",
            f"p50 {data['p50_ms']} ms, p95 {data['p95_ms']} ms, p99 {data['p99_ms']} ms, "
            f"max {data['max_ms']} ms",
        ),
        *(
            (
                f"  {status}",
                f"p50 {_ms(percentile(times, 0.5))} ms, p99 {_ms(percentile(times, 0.99))} ms",
            )
            for status, times in sorted(result.by_status.items())
        ),
        ("lost", lost),
    ]
    return "\n".join(f"{name:<14} {value}" for name, value in rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The load script's options."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.shop.load",
        description="POST /orders at a fixed rate and time each order to its final status.",
    )
    parser.add_argument("--rate", type=float, required=True, help="orders per second")
    parser.add_argument("--duration", type=float, required=True, help="seconds of sending")
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the orders service (default: :8000)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=5.0,
        help="POST /orders?wait=W: seconds the service may hold the answer (default 5; 0: poll)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help=(
            "once sending is over, the orders still pending are lost when none became "
            "final for this many seconds (default 60)"
        ),
    )
    parser.add_argument(
        "--max-settle",
        type=float,
        default=900.0,
        help="the most seconds polling goes on after the last POST (default 900)",
    )
    parser.add_argument("--in-flight", type=int, default=2000, help="most POSTs unanswered at once")
    parser.add_argument("--seed", type=int, default=None, help="seed of the orders' contents")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser.parse_args(argv)


async def _main(args: argparse.Namespace) -> LoadResult:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    total = max(1, int(args.rate * args.duration))
    with Progress(
        TextColumn("{task.description:<8}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        disable=args.json,
        transient=False,
    ) as progress:
        sent = progress.add_task("answered", total=total, note="")
        final = progress.add_task("final", total=total, note="")

        def show(result: LoadResult, pending: int) -> None:
            answered = result.accepted + sum(result.refused.values())
            refused = sum(result.refused.values())
            progress.update(sent, completed=answered, note=f"refused {refused}")
            progress.update(
                final,
                total=max(result.accepted, 1),
                completed=sum(result.statuses.values()),
                note=f"pending {pending}",
            )

        return await run_load(
            args.url,
            rate=args.rate,
            duration=args.duration,
            wait=args.wait,
            settle=args.settle,
            max_settle=args.max_settle,
            in_flight=args.in_flight,
            seed=args.seed,
            on_change=show,
        )


def main(argv: list[str] | None = None) -> int:
    """The command's entry point: 0 when every order was accepted and none was lost."""
    args = parse_args(argv)
    try:
        result = asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 130
    except httpx.HTTPError as exc:
        print(f"error: {exc}: is the shop running at {args.url}?", file=sys.stderr)
        return 1
    print(json.dumps(result.as_dict(), indent=2) if args.json else _report(result))
    return 1 if result.lost or result.refused else 0


if __name__ == "__main__":
    sys.exit(main())
