"""Sagas after an outage, on every broker + store setup (``saga_setup``).

- A reply that reached the broker while the saga's app was stopped, before its step's
  deadline, completes the step when the app comes back after the deadline; in the same run
  an order that got no reply at all times out and is compensated (the positive control).
  The participants run in one app and the saga in another, on the same broker and store.
- A compensation declared with a reply that gets none in time leaves the saga ``failed``;
  ``app.sagas.retry(..., by="ops")`` issues it again and it ends ``compensated``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from eventflow import App
from eventflow.sagas.control import WAIT_ROW

from .conftest import SERVICES, Setup
from .shop import (
    UNBOOK_TIMEOUT,
    BookingSaga,
    BookingStarted,
    Desk,
    Effects,
    Gate,
    OrderPlaced,
    OrderShipped,
    OutageSaga,
    Script,
    booking_participants,
    gated_shipping,
    participants,
)
from .test_saga_brokers import TIMEOUT, kinds, until_effects, until_status

Wait = Callable[..., Awaitable[None]]


async def _ship_deadline(app: App, key: str) -> float:
    loaded = await app.sagas.persistence.load(OutageSaga.definition, key)
    assert loaded is not None and "step:ship" in loaded.control.timers, key
    return loaded.control.timers["step:ship"].due


async def test_a_reply_sent_during_an_outage_wins_over_the_deadline(
    saga_setup: Setup, waiter: Wait
) -> None:
    """o-reply: the shipping reply is published while the saga app is down, before the
    deadline; the app comes back after the deadline: completed, nothing compensated.
    o-silent (control): no reply: timed out, refund then release.

    The app comes back as a new App (a restarted process), but on memory + memory as the
    same App object started again: its timer loop must wait for this run's consumers, not
    trust the first run's start time (it did not: the reply lost)."""
    # Enough backlog that catching up takes longer than the timer loop's first look (with
    # no wait for the consumers, every setup here fails: checked).
    memory = saga_setup.name == "memory-memory"
    await _outage(saga_setup, waiter, same_app=memory, backlog=1000 if memory else 100)


async def _outage(saga_setup: Setup, waiter: Wait, *, same_app: bool, backlog: int = 0) -> None:
    """The outage run; ``backlog`` messages for no saga wait in the broker before the reply,
    with its key (so they are handled in order before it), so the app that comes back has
    work to catch up on before its timers may fire."""
    gate = Gate(held={"o-reply"}, silent={"o-silent"})
    effects = Effects()
    groups = saga_setup.groups
    shop = saga_setup.app(
        "shop",
        handlers=[
            *participants(Script(never_ship={"o-reply", "o-silent"}), effects, groups),
            *gated_shipping(gate, effects, groups),
        ],
    )

    first = saga_setup.app("orders", sagas=[OutageSaga])

    def orders() -> App:
        return first if same_app else saga_setup.app("orders", sagas=[OutageSaga])

    async with shop:
        async with first as saga_app:
            for key in ("o-reply", "o-silent"):
                await saga_app.publish(OrderPlaced(order_id=key), key=key)
            await waiter(
                lambda: gate.arrived >= {"o-reply", "o-silent"},
                timeout=TIMEOUT,
                what="both ShipOrder commands at the shipping participant",
            )
            due = {key: await _ship_deadline(saga_app, key) for key in ("o-reply", "o-silent")}
        # The saga app is down. The participant replies now, before the deadline.
        # A backlog for no saga, but in the reply's lane (its key): handled before it.
        await asyncio.gather(
            *(
                shop.publish(OrderShipped(order_id=f"stray-{n}"), key="o-reply")
                for n in range(backlog)
            )
        )
        margin = due["o-reply"] - time.time()
        assert margin > 1.0, f"{margin:.2f}s before the deadline: too late to test anything"
        gate.opened.set()
        await waiter(lambda: "o-reply" in gate.replied_at, timeout=TIMEOUT, what="the reply")
        assert gate.replied_at["o-reply"] < due["o-reply"], "the reply came after the deadline"
        # Both deadlines pass, on the store's clock, while no saga app runs: the timer
        # rows are there and due (what the app that comes back finds).
        tables = shop.sagas.persistence

        async def both_due() -> bool:
            rows, now = await tables.earliest(OutageSaga.definition.name)
            ship = {r.key: r.due for r in rows if r.timer == WAIT_ROW}
            return ship.keys() == {"o-reply", "o-silent"} and max(ship.values()) <= now

        await waiter(both_due, timeout=TIMEOUT, what="both deadlines passed, timers kept")

        async with orders() as saga_app:
            done = await until_status(saga_app, OutageSaga, "o-reply", "completed", waiter)
            control = await until_status(saga_app, OutageSaga, "o-silent", "compensated", waiter)
        await until_effects(effects, "o-reply", ["reserved", "charged", "shipped"], waiter)
        await until_effects(
            effects,
            "o-silent",
            ["reserved", "charged", "refunded", "released"],
            waiter,
            plain_undo=2,
        )

    assert kinds(done, "ship") == ["command-sent", "replied"]
    assert "compensating" not in kinds(done)
    assert kinds(control, "ship") == ["command-sent", "timed-out"]
    sent = [t.step for t in control.history if t.kind == "compensation-sent"]
    assert sent == ["charge", "reserve"]


@pytest.mark.parametrize("saga_setup", SERVICES, indirect=True)
async def test_a_compensation_without_its_reply_fails_and_retry_resumes_it(
    saga_setup: Setup, waiter: Wait
) -> None:
    """Payment declined: ``unbook`` (declared with a reply) is sent and gets none within its
    timeout: ``failed``. A person retries it (``by="ops"``): a new command, answered this
    time: ``compensated``."""
    desk = Desk()
    effects = Effects()
    app = saga_setup.app(
        "booking",
        handlers=booking_participants(desk, effects, saga_setup.groups),
        sagas=[BookingSaga],
    )
    async with app:
        await app.publish(BookingStarted(order_id="b-1"), key="b-1")
        failed = await until_status(app, BookingSaga, "b-1", "failed", waiter)
        assert failed.reason is not None and "unbook" in failed.reason
        assert f"{UNBOOK_TIMEOUT}s" in failed.reason
        rows = await app.sagas.list(status="failed")
        assert [r.key for r in rows] == ["b-1"]
        desk.answer = True
        await app.sagas.retry(BookingSaga, "b-1", by="ops")
        done = await until_status(app, BookingSaga, "b-1", "compensated", waiter)
        await until_effects(
            effects, "b-1", ["booked", "declined", "unbook-unanswered", "unbooked"], waiter
        )

    book = [(t.kind, t.detail, t.by) for t in done.history if t.step == "book"]
    assert [k for k, _, _ in book] == [
        "command-sent",
        "replied",
        "compensation-sent",
        "timed-out",
        "failed",
        "retried",
        "compensation-sent",
        "compensated",
    ]
    assert [by for k, _, by in book if k == "retried"] == ["ops"]
    attempts = [d for k, d, _ in book if k == "compensation-sent"]
    assert attempts[0].endswith("(attempt 1)") and attempts[1].endswith("(attempt 2)")
