"""DESIGN section 5's promises under the conditions of issue 20, end to end (2 of 2).

Deadlines, timers and steps in flight, on the setups of ``saga_setup`` where the broker or
the store matters, checking what the participants did (:class:`~.promises.Ledger`):

- a timer method (or a compensation after a deadline) that raises fails its saga only;
- a reply held by a stalled member of the saga's group before the deadline wins over it,
  and a control saga whose participant never answers is compensated in the same run;
- an abort while the step's command waits in the participant's queue never lets the
  compensation overtake the command.

The rest: ``test_saga_promises.py``; a killed Kafka member holding a reply:
``tests/faults/test_saga_promises_faults.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import pytest

from eventflow import Envelope, Saga
from eventflow.brokers import open_broker

from .conftest import Setup
from .promises import (
    BROKERS,
    ENDS,
    STORES,
    Ledger,
    OrderCancelled,
    OrderPlaced,
    PromiseOrderSaga,
    ReleaseStock,
    ReserveStock,
    Shop,
    Wait,
    describe,
    kinds,
    order_participants,
    poll,
    until_ended,
)
from .promises_timed import (
    BUG,
    HELD_DEADLINE,
    BuggySaga,
    Guarded,
    Parcel,
    ParcelSaga,
    Picked,
    Ticked,
    TickingSaga,
    UndoDeadlineSaga,
    Watched,
    parcel_participants,
    watch_participants,
)

# -- 3. saga code that raises in a timer ------------------------------------------------------


@pytest.fixture
def bug() -> Any:
    """The bug of ``BuggySaga`` and ``UndoDeadlineSaga``, there for the test, fixed after."""
    BUG.fixed = False
    yield BUG
    BUG.fixed = False


@pytest.mark.parametrize("saga_setup", STORES, indirect=True)
async def test_a_timer_method_that_raises_fails_its_saga_only(
    saga_setup: Setup, waiter: Wait, bug: Any
) -> None:
    """A timer method that raises (``BuggySaga``'s ``nudge``) and a compensation that
    raises after a step's deadline (``UndoDeadlineSaga``) leave those sagas ``failed`` with
    the error; a saga of the same class and another class's deadlines still fire; the app
    stays healthy. Once the bug is fixed, ``sagas retry`` runs each again and it ends."""
    ledger = Ledger()
    app = saga_setup.app(
        "promise-watch",
        handlers=watch_participants(ledger, saga_setup.groups),
        sagas=[BuggySaga, UndoDeadlineSaga, TickingSaga],
    )
    async with app:
        await app.publish(Watched(order_id="bad-1"), key="bad-1")
        await app.publish(Guarded(order_id="undo-1"), key="undo-1")
        bad = await until_ended(app, BuggySaga, "bad-1", waiter, ENDS)
        undo = await until_ended(app, UndoDeadlineSaga, "undo-1", waiter, ENDS)
        assert bad.status == "failed", describe(bad)
        assert "a bug in the nudge timer" in (bad.reason or ""), describe(bad)
        assert undo.status == "failed", describe(undo)
        assert "a bug in undo" in (undo.reason or ""), describe(undo)

        # After the failures: the same class's timers and another class's deadlines fire.
        await app.publish(Watched(order_id="good-1"), key="good-1")
        for key in ("tick-1", "tick-2"):
            await app.publish(Ticked(order_id=key), key=key)
        good = await until_ended(app, BuggySaga, "good-1", waiter, ENDS)
        assert good.status == "completed", describe(good)
        for key in ("tick-1", "tick-2"):
            ticked = await until_ended(app, TickingSaga, key, waiter, ENDS)
            assert ticked.status == "compensated", describe(ticked)
            assert "timed-out" in kinds(ticked, "tick"), describe(ticked)
            await waiter(lambda k=key: ledger.of(k) == ["ticked", "unticked"], what=f"{key} undone")
        health = app.health()
        assert health.status == "ok", health
        assert app.failure is None, app.failure

        bug.fixed = True
        await app.sagas.retry(BuggySaga, "bad-1", by="test")
        await app.sagas.retry(UndoDeadlineSaga, "undo-1", by="test")

        async def retried(cls: type[Saga], key: str, status: str) -> Any:
            async def check() -> bool:
                saga = await app.sagas.get(cls, key)
                return saga is not None and saga.status == status

            try:
                await waiter(check, timeout=ENDS, what=f"{key} {status}")
            except pytest.fail.Exception:
                pytest.fail(f"{key} after the retry: {describe(await app.sagas.get(cls, key))}")

        await retried(BuggySaga, "bad-1", "completed")
        await retried(UndoDeadlineSaga, "undo-1", "compensated")
        await waiter(lambda: ledger.count("undone", "undo-1") == 1, what="undo-1 undone")
        assert app.health().status == "ok", app.health()
    assert ledger.count("nudged", "bad-1") == 1 and ledger.count("nudged", "good-1") == 1


# -- 4. a reply held by a stalled member of the saga's group ---------------------------------


class Stalled:
    """A member of a group that fetches and never acks (a stalled process), until closed."""

    def __init__(self) -> None:
        self.held: dict[str, float] = {}  # key -> when fetched (wall time)

    async def hold(self, sub: Any) -> None:
        """Fetch forever, keeping every delivery unacked."""
        while True:
            for delivery in await sub.fetch(32, 0.2):
                env = Envelope.from_bytes(delivery.payload)
                self.held.setdefault(env.key or "", time.time())


@asynccontextmanager
async def stalled_member(url: str, topic: str, group: str) -> AsyncIterator[Stalled]:
    """A :class:`Stalled` member of ``group`` on ``topic``; leaving, its deliveries go
    back to the group."""
    broker = open_broker(url)
    await broker.start()
    stalled = Stalled()
    try:
        sub = await broker.subscribe(topic, group=group)
        task = asyncio.create_task(stalled.hold(sub))
        try:
            yield stalled
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            await sub.close()
    finally:
        await broker.close()


WAVES = 10
WAVE = 6


@pytest.mark.timeout(180)
@pytest.mark.parametrize("saga_setup", BROKERS, indirect=True)
async def test_replies_held_by_a_stalled_member_before_the_deadline_win(
    saga_setup: Setup, waiter: Wait
) -> None:
    """A member of the saga's group (on the reply topic) fetches replies and stalls past
    the step's deadline with the app running; then it leaves. Every saga whose participant
    answered completes (none timed out), and the control, a saga whose participant never
    answers, in the same run, is compensated: the deadline does fire."""
    ledger = Ledger()
    control = "p-control"
    app = saga_setup.app(
        "promise-parcels",
        handlers=parcel_participants(ledger, saga_setup.groups, {control}),
        sagas=[ParcelSaga],
    )
    group = f"saga.{ParcelSaga.definition.name}"
    async with app:
        async with stalled_member(saga_setup.broker_url, Picked.event_type, group) as stalled:
            await app.publish(Parcel(order_id=control), key=control)
            keys: list[str] = []
            # Waves until the member holds a few replies (its share of the partitions may
            # take a moment to move to it).
            for wave in range(WAVES):
                for i in range(WAVE):
                    key = f"p-{wave}-{i}"
                    keys.append(key)
                    await app.publish(Parcel(order_id=key), key=key)
                await waiter(
                    lambda: sum(ledger.count("picked", k) for k in keys) == len(keys),
                    timeout=ENDS,
                    what="the participant answered",
                )
                await asyncio.sleep(0.3)  # for the member's fetches
                if len(stalled.held) >= 3:
                    break
            held = set(stalled.held)
            assert len(held) >= 3, f"the stalled member held {held}: the test shows nothing"
            dues = {}
            for key in held:
                saga = await app.sagas.get(ParcelSaga, key)
                assert saga is not None, key
                sent = next(t.at.timestamp() for t in saga.history if t.kind == "command-sent")
                dues[key] = sent + HELD_DEADLINE
                assert stalled.held[key] < dues[key], f"{key} held after its deadline"
            past = max(dues.values()) + 1.0
            await waiter(lambda: time.time() > past, timeout=ENDS, what="past every deadline")
        # The member left: what it held goes back to the group.
        ended = {key: await until_ended(app, ParcelSaga, key, waiter, ENDS) for key in keys}
        lost = {k: describe(s) for k, s in ended.items() if s.status != "completed"}
        assert not lost, f"{len(lost)} of {len(keys)} ({len(held)} held) lost: {lost}"
        assert not any("timed-out" in kinds(s) for s in ended.values())
        checked = await until_ended(app, ParcelSaga, control, waiter, ENDS)
        assert checked.status == "compensated", describe(checked)
        assert "timed-out" in kinds(checked, "pick"), describe(checked)
        await waiter(lambda: ledger.count("unpicked", control) == 1, what="the control undone")
    assert all(ledger.of(k) == ["picked"] for k in keys), ledger.log


# -- 6. an abort while the command waits in the participant's queue --------------------------

QUEUED = 150
TARGETS = 10


@pytest.mark.timeout(180)
@pytest.mark.parametrize("saga_setup", BROKERS, indirect=True)
async def test_an_abort_while_the_command_waits_in_a_queue_never_overtakes_it(
    saga_setup: Setup, waiter: Wait
) -> None:
    """The stock participant is held (one at a time, none applied yet) with the reserve
    commands of 150 orders and then of 10 more queued for it; those 10 are aborted. The
    stock participant then works through its queue. It sees each aborted order's reserve
    before its release, or neither: no stock held. The other orders complete."""
    shop = Shop(stock_concurrency=1)
    shop.stock_open.clear()
    app = saga_setup.app(
        "promise-queue",
        handlers=order_participants(shop, saga_setup.groups),
        sagas=[PromiseOrderSaga],
    )
    fillers = [f"q-{i:03d}" for i in range(QUEUED)]
    targets = [f"q-target-{i}" for i in range(TARGETS)]
    async with app:
        for oid in (*fillers, *targets):
            await app.publish(OrderPlaced(order_id=oid), key=oid)

        async def commands_out() -> bool:
            for oid in targets:
                saga = await app.sagas.get(PromiseOrderSaga, oid)
                if saga is None or "command-sent" not in kinds(saga, "reserve"):
                    return False
            return True

        await poll(commands_out, timeout=ENDS, what="the targets' reserve commands sent")
        assert shop.ledger.log == []  # nothing applied yet: every command is queued
        for oid in targets:
            await app.publish(OrderCancelled(order_id=oid), key=oid)

        async def aborted() -> bool:
            for oid in targets:
                saga = await app.sagas.get(PromiseOrderSaga, oid)
                if saga is None or "aborted" not in kinds(saga):
                    return False
            return True

        await poll(aborted, timeout=ENDS, what="the aborts applied", every=0.05)
        shop.stock_open.set()
        for oid in targets:
            saga = await until_ended(app, PromiseOrderSaga, oid, waiter, 120.0)
            assert saga.status == "compensated", describe(saga)

        async def filled() -> bool:
            rows = await app.sagas.list(name=PromiseOrderSaga.definition.name, limit=1000)
            done = {r.key for r in rows if r.status == "completed"}
            return done >= set(fillers)

        await poll(filled, timeout=120.0, what="the other orders completed")

        # Settled: the inventory group has handled (or skipped) every command it got.
        async def settled() -> bool:
            for topic in (ReserveStock.event_type, ReleaseStock.event_type):
                lag = await app.broker.lag(topic, group=f"{saga_setup.groups}.inventory")
                if lag.messages:
                    return False
            return True

        await poll(settled, timeout=ENDS, what="the inventory's queue drained")
    for oid in targets:
        seen = [w for w in shop.ledger.of(oid) if w in ("reserved", "released")]
        assert seen in (["reserved", "released"], []), (oid, shop.ledger.of(oid))
        assert shop.held_stock(oid) == 0, (oid, shop.ledger.of(oid))
        assert "charged" not in shop.ledger.of(oid)
