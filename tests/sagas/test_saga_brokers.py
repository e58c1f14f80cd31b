"""The order saga, a pivot, an abort and named timers on memory + SQLite, NATS + PostgreSQL
and Kafka + PostgreSQL (``saga_setup``).

Each test starts one app with the participants and the sagas, runs several sagas at once
(one key each) and checks every outcome: the status, the history and every participant
effect, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from eventflow import App, Saga
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig

from .conftest import SERVICES, Setup
from .shop import (
    EXPIRY,
    REMINDER_AGAIN,
    REMINDER_FIRST,
    Effects,
    OrderPlaced,
    OrderSaga,
    PivotCancelled,
    PivotSaga,
    PivotStarted,
    Script,
    TimerSaga,
    TimersStarted,
    participants,
    pivot_participants,
    timer_participants,
)

Wait = Callable[..., Awaitable[None]]
TIMEOUT = 30.0


async def until_status(
    app: App, cls: type[Saga], key: str, status: str, waiter: Wait, timeout: float = TIMEOUT
) -> Any:
    """Wait (bounded by ``timeout``) until the saga of ``key`` has ``status``; return it."""
    seen: list[str | None] = [None]

    async def check() -> bool:
        saga = await app.sagas.get(cls, key)
        seen[0] = None if saga is None else saga.status
        return seen[0] == status

    try:
        await waiter(check, timeout=timeout, what=f"{cls.__name__} {key} {status}")
    except pytest.fail.Exception:
        saga = await app.sagas.get(cls, key)
        history = [] if saga is None else [(t.kind, t.step, t.detail) for t in saga.history]
        pytest.fail(f"{cls.__name__} {key} is {seen[0]}, not {status}: {history}")
    return await app.sagas.get(cls, key)


async def until_effects(
    effects: Effects, key: str, expected: list[str], waiter: Wait, *, plain_undo: int = 0
) -> None:
    """Wait (bounded) until ``key`` has as many effects as expected, then compare them in
    order, but for the last ``plain_undo``: plain compensations count as done once issued
    (so their effects may come later) and participants on different topics may apply them
    in any order; the order they were issued in is in the saga's history."""
    await waiter(
        lambda: len(effects.of(key)) >= len(expected),
        timeout=TIMEOUT,
        what=f"effects of {key}: {expected} (have {effects.of(key)})",
    )
    got = effects.of(key)
    cut = len(expected) - plain_undo
    assert got[:cut] == expected[:cut] and sorted(got[cut:]) == sorted(expected[cut:]), key


def kinds(saga: Any, step: str | None = None) -> list[str]:
    """The transition kinds of a saga (of one step)."""
    return [t.kind for t in saga.history if step is None or t.step == step]


@pytest.mark.parametrize("saga_setup", SERVICES, indirect=True)
async def test_the_order_saga(saga_setup: Setup, waiter: Wait) -> None:
    """Reserve, charge, ship: completed; stock rejected: nothing compensated; payment
    declined: stock released; shipping times out: refund, then release; a second start
    event for one key: one saga."""
    script = Script(reject_stock={"o-rej"}, decline={"o-dec"}, never_ship={"o-late"})
    effects = Effects()
    app = saga_setup.app(
        "orders", handlers=participants(script, effects, saga_setup.groups), sagas=[OrderSaga]
    )
    async with app:
        for oid in ("o-ok", "o-rej", "o-dec", "o-late"):
            await app.publish(OrderPlaced(order_id=oid), key=oid)
        await app.publish(OrderPlaced(order_id="o-ok", amount=999), key="o-ok")  # again
        ok = await until_status(app, OrderSaga, "o-ok", "completed", waiter)
        rej = await until_status(app, OrderSaga, "o-rej", "compensated", waiter)
        dec = await until_status(app, OrderSaga, "o-dec", "compensated", waiter)
        late = await until_status(app, OrderSaga, "o-late", "compensated", waiter)

        async def second_start_seen() -> bool:
            saga = await app.sagas.get(OrderSaga, "o-ok")
            return saga is not None and "ignored" in kinds(saga)

        await waiter(second_start_seen, timeout=TIMEOUT, what="the second start, ignored")
        ok = await app.sagas.get(OrderSaga, "o-ok")
        await until_effects(effects, "o-ok", ["reserved", "charged", "shipped"], waiter)
        await until_effects(effects, "o-rej", [], waiter)
        await until_effects(effects, "o-dec", ["reserved", "released"], waiter)
        await until_effects(
            effects, "o-late", ["reserved", "charged", "refunded", "released"], waiter, plain_undo=2
        )
        rows = await app.sagas.list(status="compensated")
        assert {r.key for r in rows} == {"o-rej", "o-dec", "o-late"}

    assert ok is not None and ok.charge_id == "ch-o-ok" and ok.amount == 100  # the first start
    assert kinds(ok).count("started") == 1
    assert next(t for t in ok.history if t.kind == "ignored").detail.startswith("a second")
    assert kinds(ok, "ship") == ["command-sent", "replied"]
    # stock rejected: nothing was done, so nothing is compensated
    assert "compensation-sent" not in kinds(rej) and kinds(rej, "reserve")[-1] == "rejected"
    assert kinds(dec, "reserve")[-1] == "compensation-sent"
    assert "compensation-sent" not in kinds(dec, "charge")  # a rejected step is not undone
    # shipping timed out: refund, then release, newest first
    sent = [t.step for t in late.history if t.kind == "compensation-sent"]
    assert sent == ["charge", "reserve"] and "timed-out" in kinds(late, "ship")


@pytest.mark.parametrize("saga_setup", SERVICES, indirect=True)
async def test_pivot_abort_and_timers(saga_setup: Setup, waiter: Wait) -> None:
    """After the pivot a step rejected twice is sent again (a new command each time) and
    succeeds, nothing compensated; an abort event before the pivot compensates what was
    done; a named timer is rescheduled (fires once, early) and one is cancelled."""
    effects = Effects()
    groups = saga_setup.groups
    app = saga_setup.app(
        "pivots",
        handlers=[
            *pivot_participants(effects, fail_first=2, stall=frozenset({"p-abort"}), group=groups),
            *timer_participants(effects, group=groups),
        ],
        sagas=[PivotSaga, TimerSaga],
    )
    async with app:
        for key in ("p-retry", "p-abort"):
            await app.publish(PivotStarted(order_id=key), key=key)
        await app.publish(TimersStarted(order_id="t-1"), key="t-1")
        await waiter(
            lambda: ("stalled", "p-abort") in effects.log, timeout=TIMEOUT, what="p-abort waits"
        )
        await app.publish(PivotCancelled(order_id="p-abort"), key="p-abort")

        retried = await until_status(app, PivotSaga, "p-retry", "completed", waiter)
        # The abort waits for the stalled step's outcome: its 30 s step timeout, which came
        # due just inside a 30 s wait (the test took 30-33 s) and past it under load.
        aborted = await until_status(
            app, PivotSaga, "p-abort", "compensated", waiter, timeout=TIMEOUT + 30.0
        )
        timed = await until_status(app, TimerSaga, "t-1", "completed", waiter)
        await until_effects(
            effects,
            "p-retry",
            ["held", "confirmed", "delivery-failed", "delivery-failed", "delivered"],
            waiter,
        )
        await until_effects(effects, "p-abort", ["held", "stalled", "freed"], waiter)
        await until_effects(effects, "t-1", ["asked", "reminded"], waiter)

    # past the pivot: rejected twice, retried, then it succeeded; nothing compensated
    assert kinds(retried, "deliver") == [
        "command-sent",
        "rejected",
        "retry-scheduled",
        "command-sent",
        "rejected",
        "retry-scheduled",
        "command-sent",
        "replied",
    ]
    attempts = [
        t.detail for t in retried.history if t.kind == "command-sent" and t.step == "deliver"
    ]
    assert [a.rsplit(" ", 1)[-1] for a in attempts] == ["1)", "2)", "3)"]
    assert "compensating" not in kinds(retried)
    # the abort event: the seat held is freed
    assert "aborted" in kinds(aborted)
    assert [t.step for t in aborted.history if t.kind == "compensation-sent"] == ["hold"]
    # timers: expire cancelled (it would have aborted the saga), reminder rescheduled
    set_ = [t.detail for t in timed.history if t.kind == "timer-set"]
    assert set_[0] == f"reminder in {REMINDER_FIRST:g}s"
    assert f"reminder in {REMINDER_AGAIN:g}s" in set_
    assert [t.detail for t in timed.history if t.kind == "timer-cancelled"] == ["expire"]
    assert [t.detail for t in timed.history if t.kind == "timer-fired"] == ["reminder"]
    started = timed.history[0].at
    fired = next(t.at for t in timed.history if t.kind == "timer-fired")
    assert (fired - started).total_seconds() < REMINDER_FIRST / 2  # the new time, not the old
    assert (fired - started).total_seconds() > EXPIRY  # expire's time passed, cancelled


class _CountingBroker(MemoryBroker):
    """A memory broker whose ``subscribe`` calls wait until ``expected`` of them are under
    way at once (bounded): joins made one after another time out here."""

    def __init__(self, name: str, expected: int) -> None:
        super().__init__(MemoryBrokerConfig(name=name))
        self.expected = expected
        self.joining = 0
        self.most = 0
        self._all = asyncio.Event()

    async def subscribe(self, pattern: str, *, group: str, start: Any = "latest") -> Any:
        self.joining += 1
        self.most = max(self.most, self.joining)
        if self.joining >= self.expected:
            self._all.set()
        try:
            await asyncio.wait_for(self._all.wait(), 2.0)
        except TimeoutError:
            pass
        finally:
            self.joining -= 1
        return await super().subscribe(pattern, group=group, start=start)


async def test_an_app_joins_its_subscriptions_at_once(broker_name: str) -> None:
    """A saga's handlers (one per event type, one group) join together: on Kafka each join
    is a group rebalance of about a second, so one after another an app with the order saga
    took 13 s to start (20 s with its participants)."""
    effects = Effects()
    handlers = participants(Script(), effects, "shop")
    expected = len(handlers) + len(OrderSaga.definition.input_types())
    broker = _CountingBroker(broker_name, expected)
    app = App("orders", broker=broker, handlers=handlers, sagas=[OrderSaga])
    async with app:
        assert broker.most == expected
