"""The saga timer loop (``sagas.timers``) in running apps, one rule per test:

- deadlines are on the store's clock (a memory store with a clock the test moves);
- a reply held by a stalled member of the saga's group before the deadline wins while the
  app runs, with a no-reply control of the same class and one of another class timing out
  in the same run, and no busy poll while the deadlines wait;
- saga code that raises in a timer leaves that saga ``failed`` (retryable) while the
  other sagas' deadlines fire and the app stays healthy;
- a firing whose lease was taken over commits nothing (``Leases.fence``), on memory,
  SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from eventflow import App, Event, Saga, on_timer, step
from eventflow.adapters.memory import MemoryBroker, MemoryStore
from eventflow.errors import LeaseLostError
from eventflow.ports import Store
from eventflow.sagas.catch_up import MIN_RECHECK
from eventflow.sagas.timers import SagaTimers, _Wakeup, timer_lease
from eventflow.stores import open_store

Wait = Callable[..., Awaitable[None]]
ASK_TIMEOUT = 1.0


class TStart(Event, type="sagatest.tl.start"):
    order_id: str


class TAsk(Event, type="sagatest.tl.ask"):
    order_id: str


class TAnswer(Event, type="sagatest.tl.answer"):
    order_id: str


class AskSaga(Saga, name="sagatest.tl.asker", start=TStart, key="order_id"):
    """One step that nobody answers unless the test publishes the answer."""

    order_id: str = ""

    def started(self, e: TStart) -> None:
        self.order_id = e.order_id

    @step(reply=TAnswer, timeout=ASK_TIMEOUT)
    def ask(self) -> Event:
        return TAsk(order_id=self.order_id)


class OStart(Event, type="sagatest.tl.other.start"):
    order_id: str


class OAsk(Event, type="sagatest.tl.other.ask"):
    order_id: str


class OAnswer(Event, type="sagatest.tl.other.answer"):
    order_id: str


class OtherSaga(Saga, name="sagatest.tl.other", start=OStart, key="order_id"):
    """Another class: its own group, its own timer loop."""

    order_id: str = ""

    def started(self, e: OStart) -> None:
        self.order_id = e.order_id

    @step(reply=OAnswer, timeout=0.3)
    def ask(self) -> Event:
        return OAsk(order_id=self.order_id)


class BStart(Event, type="sagatest.tl.buggy.start"):
    order_id: str
    bug: bool = True


class BAsk(Event, type="sagatest.tl.buggy.ask"):
    order_id: str


class BAnswer(Event, type="sagatest.tl.buggy.answer"):
    order_id: str


class BuggySaga(Saga, name="sagatest.tl.buggy", start=BStart, key="order_id"):
    """Its ``nudge`` timer raises for a saga started with ``bug`` (and not once fixed)."""

    order_id: str = ""
    bug: bool = True
    nudged: int = 0

    def started(self, e: BStart) -> None:
        self.order_id, self.bug = e.order_id, e.bug
        self.set_timer("nudge", 0.05)

    @step(reply=BAnswer, timeout=30.0)
    def ask(self) -> Event:
        return BAsk(order_id=self.order_id)

    @on_timer("nudge")
    def _nudge(self) -> None:
        if self.bug and self.order_id not in FIXED:
            raise RuntimeError(f"a bug in nudge for {self.order_id}")
        self.nudged += 1


FIXED: set[str] = set()


class CStart(Event, type="sagatest.tl.comp.start"):
    order_id: str


class CHold(Event, type="sagatest.tl.comp.hold"):
    order_id: str


class CHeld(Event, type="sagatest.tl.comp.held"):
    order_id: str


class CFree(Event, type="sagatest.tl.comp.free"):
    order_id: str


class CompSaga(Saga, name="sagatest.tl.comp", start=CStart, key="order_id"):
    """Its step times out (nobody answers) and its compensation, run by the timer, raises."""

    order_id: str = ""

    def started(self, e: CStart) -> None:
        self.order_id = e.order_id

    @step(reply=CHeld, timeout=0.2)
    def hold(self) -> Event:
        return CHold(order_id=self.order_id)

    @hold.compensate
    def free(self) -> Event:
        raise ValueError(f"cannot free {self.order_id}")


def _timers(app: App) -> SagaTimers:
    return app._saga_runtime.timers


async def _status(app: App, cls: type[Saga], key: str) -> str | None:
    saga = await app.sagas.get(cls, key)
    return None if saga is None else saga.status


async def _sent(app: App, cls: type[Saga], key: str) -> bool:
    saga = await app.sagas.get(cls, key)
    return saga is not None and any(t.kind == "command-sent" for t in saga.history)


async def _timed_out(app: App, cls: type[Saga], key: str) -> bool:
    saga = await app.sagas.get(cls, key)
    return saga is not None and any(t.kind == "timed-out" for t in saga.history)


async def _deadline(app: App, key: str) -> float:
    loaded = await app.sagas.persistence.load(AskSaga.definition, key)
    assert loaded is not None and "step:ask" in loaded.control.timers, key
    return loaded.control.timers["step:ask"].due


class Clock:
    """The memory store's clock, frozen until the test moves it."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


async def test_a_deadline_is_due_on_the_store_clock(broker_url: str, waiter: Wait) -> None:
    """The store's clock stands still: the step's timeout passes on this process's clock
    while the loop looks again and again, and nothing fires; once the store's clock passes
    the deadline, it fires."""
    clock = Clock()
    app = App("tl", broker=broker_url, store=MemoryStore(clock=clock), sagas=[AskSaga])
    async with app:
        await app.publish(TStart(order_id="c-1"), key="c-1")
        await waiter(lambda: _sent(app, AskSaga, "c-1"), what="the ask command")
        began, looks = time.time(), _timers(app).looks.get(AskSaga.definition.name, 0)

        def looked_past_the_timeout() -> bool:
            seen = _timers(app).looks.get(AskSaga.definition.name, 0)
            return seen >= looks + 3 and time.time() > began + ASK_TIMEOUT

        await waiter(looked_past_the_timeout, what="three looks, past the timeout")
        assert await _status(app, AskSaga, "c-1") == "running"
        assert not await _timed_out(app, AskSaga, "c-1")
        clock.now += ASK_TIMEOUT + 0.01  # the control: now it is due on the store's clock
        await waiter(lambda: _timed_out(app, AskSaga, "c-1"), what="the timeout")
        assert await _status(app, AskSaga, "c-1") == "compensated"


async def test_replies_held_by_a_stalled_member_win_while_the_app_runs(
    broker_url: str, hub: MemoryBroker, waiter: Wait
) -> None:
    """16 sagas whose answers reach the broker before their deadline, some of them held
    (fetched, never acked) by a stalled member of the saga's group while the app runs: none
    times out; once the member leaves, every one completes. Controls in the same run: a saga
    of the class whose deadline passed before the answers were sent, and one of another
    class whose deadline passes while the answers are held: both time out. While the
    deadlines wait, the loop looks and asks the broker only when something can change."""
    keys = [f"h-{n}" for n in range(16)]
    group = f"saga.{AskSaga.definition.name}"
    app = App("tl", broker=broker_url, store=MemoryStore(), sagas=[AskSaga, OtherSaga])
    async with app:
        stalled = await hub.subscribe(TAnswer.event_type, group=group)
        await app.publish(TStart(order_id="control"), key="control")
        await waiter(lambda: _sent(app, AskSaga, "control"), what="the control's command")
        await asyncio.sleep(ASK_TIMEOUT * 0.6)  # the 16 deadlines come this much later
        for key in keys:
            await app.publish(TStart(order_id=key), key=key)

        async def all_sent() -> bool:
            return all([await _sent(app, AskSaga, k) for k in keys])

        await waiter(all_sent, what="the 16 commands")
        await waiter(lambda: _timed_out(app, AskSaga, "control"), what="the control's timeout")
        dues = {k: await _deadline(app, k) for k in keys}
        assert time.time() < min(dues.values()) - 0.05, "too late to test anything"
        for key in keys:
            await app.publish(TAnswer(order_id=key), key=key)
        await app.publish(OStart(order_id="other"), key="other")
        held = await stalled.fetch(len(keys), 2.0)
        assert held, "the stalled member holds no answer: nothing is tested"
        held_keys = {d.key for d in held}
        # The other class's deadline (0.3 s) passes while the answers are held: it fires.
        await waiter(lambda: _timed_out(app, OtherSaga, "other"), what="the other's timeout")
        # Past every deadline of the 16, the loop asked the broker again (a recheck) and
        # still none timed out.
        catch_up = _timers(app).catch_ups[AskSaga.definition.name]
        asks, looks = catch_up.asks, _timers(app).looks[AskSaga.definition.name]
        deadline = max(dues[k] for k in held_keys)
        await waiter(
            lambda: time.time() > deadline and catch_up.asks >= asks + 2,
            what="two asks past the held sagas' deadlines",
        )
        for key in held_keys:
            assert not await _timed_out(app, AskSaga, key), key
            assert await _status(app, AskSaga, key) == "running", key
        # No busy poll: a look per ask, about (main looked ~180 times a second).
        extra_looks = _timers(app).looks[AskSaga.definition.name] - looks
        assert extra_looks <= 2 * (catch_up.asks - asks) + 4, (extra_looks, catch_up.asks)
        await stalled.close()  # the member leaves: the answers go back to the group

        async def all_completed() -> bool:
            return all([await _status(app, AskSaga, k) == "completed" for k in keys])

        await waiter(all_completed, what="all 16 completed")
        for key in keys:
            assert not await _timed_out(app, AskSaga, key), key


async def test_a_timer_method_that_raises_fails_its_saga_only(
    broker_url: str, waiter: Wait
) -> None:
    """``nudge`` raises for b-bug: that saga is ``failed`` with the error in its history;
    b-ok's nudge runs, and another class's deadline fires; the app stays healthy. Once the
    code is fixed, ``sagas retry`` resumes the failed saga."""
    app = App("tl", broker=broker_url, store=MemoryStore(), sagas=[BuggySaga, OtherSaga])
    async with app:
        await app.publish(BStart(order_id="b-bug"), key="b-bug")
        await waiter(lambda: _status(app, BuggySaga, "b-bug"), what="b-bug started")
        await waiter(lambda: _status_is(app, BuggySaga, "b-bug", "failed"), what="b-bug failed")
        await app.publish(BStart(order_id="b-ok", bug=False), key="b-ok")
        await app.publish(OStart(order_id="o-1"), key="o-1")

        async def nudged() -> bool:
            saga = await app.sagas.get(BuggySaga, "b-ok")
            return saga is not None and saga.nudged == 1

        await waiter(nudged, what="b-ok's nudge")
        await waiter(lambda: _timed_out(app, OtherSaga, "o-1"), what="the other's deadline")
        assert app.health().ok, app.health()
        failed = await app.sagas.get(BuggySaga, "b-bug")
        assert failed is not None and failed.reason is not None
        assert "RuntimeError('a bug in nudge for b-bug')" in failed.reason
        assert [t.kind for t in failed.history][-1] == "failed"
        assert [r.key for r in await app.sagas.list(status="failed")] == ["b-bug"]
        assert _timers(app).failed == 1
        FIXED.add("b-bug")
        try:
            await app.sagas.retry(BuggySaga, "b-bug", by="ops")
            assert await _status(app, BuggySaga, "b-bug") == "running"
        finally:
            FIXED.discard("b-bug")
        assert app.health().ok


async def test_a_compensation_that_raises_after_a_timeout_fails_its_saga_only(
    broker_url: str, waiter: Wait
) -> None:
    """The step times out; its compensation (run by the timer loop) raises: that saga is
    ``failed`` with the error, the other saga of the class fails alike, another class's
    deadline fires, and the app stays healthy."""
    app = App("tl", broker=broker_url, store=MemoryStore(), sagas=[CompSaga, OtherSaga])
    async with app:
        for key in ("c-1", "c-2"):
            await app.publish(CStart(order_id=key), key=key)
        await app.publish(OStart(order_id="o-1"), key="o-1")
        for key in ("c-1", "c-2"):
            await waiter(lambda k=key: _status_is(app, CompSaga, k, "failed"), what=key)
        await waiter(lambda: _timed_out(app, OtherSaga, "o-1"), what="the other's deadline")
        saga = await app.sagas.get(CompSaga, "c-1")
        assert saga is not None and saga.reason is not None
        assert "ValueError('cannot free c-1')" in saga.reason
        assert "step:hold" in saga.reason
        # Rolled back to before the timer: no half-done timeout in the history.
        assert [t.kind for t in saga.history][-2:] == ["command-sent", "failed"]
        assert app.health().ok, app.health()


async def _status_is(app: App, cls: type[Saga], key: str, status: str) -> bool:
    return await _status(app, cls, key) == status


STORES = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.service("postgres")),
]


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | Store:
    kind: str = request.param
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'timers.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


async def test_a_firing_under_a_lease_taken_over_commits_nothing(
    broker_url: str, store_url: str | Store, waiter: Wait
) -> None:
    """The loop's lease changed hands: its firing is refused by the fence and the saga
    still waits; the new holder's loop fires it."""
    async with open_store(store_url) as store:
        app = App("tl", broker=broker_url, store=store, sagas=[AskSaga])
        runtime = app._saga_runtime
        async with store.leases.hold(timer_lease(AskSaga.definition)) as stale:
            pass
        async with app:
            await app.publish(TStart(order_id="f-1"), key="f-1")
            await waiter(lambda: _sent(app, AskSaga, "f-1"), what="the command")
            rows, _ = await app.sagas.persistence.earliest(AskSaga.definition.name)
            (row,) = rows
            with pytest.raises(LeaseLostError):
                await runtime.timers._fire(AskSaga, row, stale)
            assert await _status(app, AskSaga, "f-1") == "running"
            assert not await _timed_out(app, AskSaga, "f-1")
            await waiter(lambda: _timed_out(app, AskSaga, "f-1"), what="the holder's firing")
            saga = await app.sagas.get(AskSaga, "f-1")
            assert saga is not None
            assert [t.kind for t in saga.history].count("timed-out") == 1


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_handled_message_wakes_a_loop_only_while_a_deadline_waits() -> None:
    idle = _Wakeup()
    sleeping = asyncio.ensure_future(idle.sleep(30.0, catch_up=False))
    await _settle()
    idle.handled()  # nothing waits for the catch-up: no look
    await _settle()
    assert not sleeping.done()
    idle.timer_set(60.0)  # due after its next look: no look either
    await _settle()
    assert not sleeping.done()
    idle.timer_set(0.0)  # due before: it looks now
    await asyncio.wait_for(sleeping, 1.0)


async def test_handled_messages_wake_a_waiting_loop_at_most_every_min_recheck() -> None:
    """A busy group while a deadline waits: the first handled message right after a look
    wakes the loop only MIN_RECHECK after that look (not once per message); a timer set
    meanwhile wakes it at once."""
    held = _Wakeup()
    began = time.monotonic()
    sleeping = asyncio.ensure_future(held.sleep(30.0, catch_up=True))
    await _settle()
    for _ in range(20):
        held.handled()
        await _settle()
    await asyncio.wait_for(sleeping, 5.0)
    assert time.monotonic() - began >= MIN_RECHECK * 0.9  # spaced, then woken
    again = asyncio.ensure_future(held.sleep(30.0, catch_up=True))
    await _settle()
    held.handled()
    await _settle()
    assert not again.done()
    held.timer_set(0.0)  # a timer due now is not held back by the spacing
    await asyncio.wait_for(again, 1.0)


async def test_a_timer_set_while_the_loop_looks_ends_its_next_sleep_only_by_its_due_time() -> None:
    """A timer committed while the loop queries may or may not be in what it read: the
    sleep after that look ends by the timer's due time, and no sooner when that is after
    the sleep's end (a busy saga class does not make the loop look again after each look)."""
    busy = _Wakeup()
    busy.timer_set(60.0)  # while it looks (it has not gone to sleep yet)
    sleeping = asyncio.ensure_future(busy.sleep(30.0, catch_up=False))
    await _settle()
    assert not sleeping.done()
    sleeping.cancel()
    near = _Wakeup()
    near.timer_set(0.0)  # while it looks, due before its next look: the sleep is short
    await asyncio.wait_for(near.sleep(30.0, catch_up=False), 1.0)
