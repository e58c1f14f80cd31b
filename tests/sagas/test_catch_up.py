"""The reply-in-the-broker rule of saga deadlines (``sagas.catch_up``): a due deadline fires
once every message of the saga's group the broker accepted before it was handled (the
oldest pending message on each pattern was published after it, or none is pending), at
most ``catch_up_limit`` past it; a failed lag call fires nothing. Unit tests of the rule,
then apps on the memory broker with a member of the saga's group holding a reply."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import pytest

from eventflow import App
from eventflow.adapters.memory.broker import MemoryBroker, MemoryBrokerConfig
from eventflow.errors import BrokerError, ConfigurationError
from eventflow.ports import Broker, Lag, Subscription
from eventflow.sagas.catch_up import MIN_RECHECK, RECHECK, CatchUp
from eventflow.sagas.control import WAIT_ROW, Timer, TimerKind, timer_row
from eventflow.sagas.persistence import SagaStore
from eventflow.sagas.timers import answering
from eventflow.stores import open_store

from .shop import (
    Effects,
    OrderPlaced,
    OrderSaga,
    OrderShipped,
    Script,
    StockRejected,
    StockReserved,
    participants,
)

Wait = Callable[..., Awaitable[None]]


class ScriptedLag:
    """What ``Broker.lag`` answers for the saga's group, per pattern, or raises: a unit
    test of the rule (the app tests below use the memory broker's real lag)."""

    def __init__(self) -> None:
        self.answers: dict[str, Lag | Exception] = {}
        self.asked: list[str] = []

    async def lag(self, pattern: str, *, group: str) -> Lag:
        assert group == GROUP
        self.asked.append(pattern)
        answer = self.answers.get(pattern, Lag(0, None))
        if isinstance(answer, Exception):
            raise answer
        return answer


GROUP = f"saga.{OrderSaga.definition.name}"
PATTERNS = [t.event_type for t in OrderSaga.definition.input_types()]


def _catch_up(broker: ScriptedLag, *, limit: float = 30.0, started_at: float = 0.0) -> CatchUp:
    return CatchUp(cast(Broker, broker), GROUP, limit=limit, started_at=started_at)


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


async def test_a_deadline_fires_once_nothing_accepted_before_it_is_pending() -> None:
    broker = ScriptedLag()
    catch_up = _catch_up(broker)
    due = time.time() - 5
    broker.answers[OrderShipped.event_type] = Lag(1, _at(due - 1))  # a reply, before it
    assert await catch_up.wait_for(due, due + 1, PATTERNS) == RECHECK
    assert sorted(broker.asked) == sorted(PATTERNS)  # every pattern of the group
    # Asked again within MIN_RECHECK: no ask, a shorter wait.
    pause = await catch_up.wait_for(due, due + 1, PATTERNS)
    assert pause is not None and 0 < pause <= MIN_RECHECK and catch_up.asks == 1
    await asyncio.sleep(MIN_RECHECK)
    broker.answers[OrderShipped.event_type] = Lag(1, _at(due + 0.5))  # after it: late
    assert await catch_up.wait_for(due, due + 1, PATTERNS) is None
    assert catch_up.asks == 2
    # What the ask showed stays true: an earlier deadline needs no ask.
    assert await catch_up.wait_for(due - 3, due + 1, PATTERNS) is None
    assert catch_up.asks == 2
    # A later one (after the oldest pending message) waits again.
    assert await catch_up.wait_for(due + 1, due + 2, PATTERNS) is not None


async def test_nothing_pending_clears_every_deadline_up_to_the_ask() -> None:
    broker = ScriptedLag()
    catch_up = _catch_up(broker)
    now = time.time()
    assert await catch_up.wait_for(now - 0.01, now, PATTERNS) is None
    assert catch_up.asks == 1 and min(catch_up.clear_until.values()) >= now


def _timer(kind: TimerKind, name: str) -> Timer:
    """A typed timer as the saga's control holds it (the deadline row is shared)."""
    return Timer(kind, name, 0.0, "1:x", timer_row(kind, name))


def test_a_step_deadline_is_answered_on_its_reply_and_reject_topics_only() -> None:
    definition = OrderSaga.definition
    assert answering(definition, _timer(TimerKind.DEADLINE, "ship")) == [OrderShipped.event_type]
    assert answering(definition, _timer(TimerKind.BACKOFF, "reserve")) == [
        StockReserved.event_type,
        StockRejected.event_type,
    ]
    named = answering(definition, _timer(TimerKind.NAMED, "reminder"))
    assert OrderPlaced.event_type not in named  # a start answers no timer
    assert set(named) == set(PATTERNS) - {OrderPlaced.event_type}
    assert answering(definition, _timer(TimerKind.DEADLINE, "gone")) == named  # removed step
    assert answering(definition, None) == named  # a row whose timer the saga no longer has


async def test_a_start_in_flight_holds_no_step_deadline() -> None:
    """Under load a start (of another saga) is always in flight: it must not delay every
    step deadline (it did, by the recheck interval, when every topic counted)."""
    broker = ScriptedLag()
    catch_up = _catch_up(broker)
    due = time.time() - 0.01
    broker.answers[OrderPlaced.event_type] = Lag(1, _at(due - 0.005))
    broker.answers[OrderShipped.event_type] = Lag(1, _at(due - 0.005))  # the control
    ship = answering(OrderSaga.definition, _timer(TimerKind.DEADLINE, "ship"))
    reserve = answering(OrderSaga.definition, _timer(TimerKind.DEADLINE, "reserve"))
    assert await catch_up.wait_for(due, due + 0.01, reserve) is None
    assert await catch_up.wait_for(due, due + 0.01, ship) is not None
    assert OrderPlaced.event_type not in broker.asked


async def test_a_failed_lag_call_never_fires_a_deadline() -> None:
    """A broker that cannot answer means wait and ask again (main fired the timer)."""
    broker = ScriptedLag()
    catch_up = _catch_up(broker)
    due = time.time() - 5
    broker.answers[StockReserved.event_type] = BrokerError("down")
    for _ in range(3):
        assert await catch_up.wait_for(due, due + 1, PATTERNS) == RECHECK
        await asyncio.sleep(MIN_RECHECK)
    assert catch_up.failed == 3
    del broker.answers[StockReserved.event_type]  # the broker is back: nothing pending
    assert await catch_up.wait_for(due, due + 1, PATTERNS) is None


async def test_the_limit_bounds_the_wait_from_the_deadline_or_the_start() -> None:
    broker = ScriptedLag()
    broker.answers[OrderShipped.event_type] = BrokerError("down")
    start = time.time()
    catch_up = _catch_up(broker, limit=5.0, started_at=start)
    # A deadline while running: at most 5 s past it.
    assert await catch_up.wait_for(start + 10, start + 14.9, PATTERNS) is not None
    assert await catch_up.wait_for(start + 10, start + 15, PATTERNS) is None
    # A deadline that passed before the start (an outage): 5 s past the start.
    assert await catch_up.wait_for(start - 100, start + 4.9, PATTERNS) is not None
    assert await catch_up.wait_for(start - 100, start + 5, PATTERNS) is None
    # No broker (a test kit's clock): nothing can be pending.
    no_broker = CatchUp(None, GROUP, limit=5.0, started_at=start)
    assert await no_broker.wait_for(start - 1, start, PATTERNS) is None


@dataclass(frozen=True)
class _Held:
    url: str  # the broker's
    store: str  # the saga app's
    stuck: Subscription  # the member of the saga's group that holds the reply


@asynccontextmanager
async def _a_reply_held_past_its_deadline(
    broker_name: str, tmp_path: Path, waiter: Wait, effects: Effects
) -> AsyncIterator[_Held]:
    """The saga process ran until the ship commands of o-2 (the control), then o-1, went
    out, about half a second apart, then stopped. o-1's reply reached the broker after the
    control's deadline and before its own (1 s), and a member of the saga's group that no
    longer answers holds it (unacked: only a member's leaving gives it back); the control
    gets no reply. Both deadlines have passed on the store's clock. Yields where
    (:class:`_Held`), while the participants still run."""
    url, store = f"memory://{broker_name}", f"sqlite:///{tmp_path / 'sagas.db'}"
    hub = MemoryBroker(MemoryBrokerConfig(name=broker_name))  # keeps the hub's groups
    await hub.start()
    try:
        async with App(
            "shop",
            broker=url,
            handlers=participants(Script(never_ship={"o-1", "o-2"}), effects),
        ) as shop:
            async with App("orders", broker=url, store=store, sagas=[OrderSaga]) as orders:

                async def shipping(key: str) -> bool:
                    saga = await orders.sagas.get(OrderSaga, key)
                    return saga is not None and any(
                        t.kind == "command-sent" and t.step == "ship" for t in saga.history
                    )

                await shop.publish(OrderPlaced(order_id="o-2"), key="o-2")
                await waiter(lambda: shipping("o-2"))
                await asyncio.sleep(0.5)
                await shop.publish(OrderPlaced(order_id="o-1"), key="o-1")
                await waiter(lambda: shipping("o-1"))
                due = {k: await _ship_due(orders, k) for k in ("o-1", "o-2")}
                assert time.time() < due["o-2"], "the control's deadline passed too early"
            group = f"saga.{OrderSaga.definition.name}"
            stuck = await hub.subscribe(OrderShipped.event_type, group=group)
            await asyncio.sleep(max(0.0, due["o-2"] + 0.05 - time.time()))
            await shop.publish(OrderShipped(order_id="o-1"), key="o-1")
            assert time.time() < due["o-1"], "the reply came after o-1's deadline"
            held = await stuck.fetch(1, 5.0)
            assert len(held) == 1  # the reply, before the deadline, held and never acked
            assert (await hub.lag(OrderShipped.event_type, group=group)).messages == 1
            async with open_store(store) as saga_store:
                tables = SagaStore(saga_store)

                async def both_due() -> bool:
                    rows, now = await tables.earliest(OrderSaga.definition.name)
                    return len(rows) == 2 and all(r.due <= now for r in rows)

                await waiter(both_due, what="both deadlines passed on the store's clock")
            yield _Held(url, store, stuck)
    finally:
        await hub.close()


async def _ship_due(app: App, key: str) -> float:
    rows, _ = await app.sagas.persistence.earliest(OrderSaga.definition.name)
    return next(r.due for r in rows if r.key == key and r.timer == WAIT_ROW)


async def test_a_reply_held_by_a_stuck_member_wins_over_the_overdue_timeout(
    broker_name: str, tmp_path: Path, waiter: Wait
) -> None:
    """A reply held past its deadline (see the helper above): the saga process starts after
    both deadlines. The control, whose deadline came before the reply was published, times
    out; in the same look o-1's deadline waits (the reply is pending on its topic, published
    before it), and once the member is gone the reply is handled and o-1 completes."""
    effects = Effects()
    async with (
        _a_reply_held_past_its_deadline(broker_name, tmp_path, waiter, effects) as held,
        App("orders", broker=held.url, store=held.store, sagas=[OrderSaga]) as orders,
    ):

        async def control_compensated() -> bool:
            saga = await orders.sagas.get(OrderSaga, "o-2")
            return saga is not None and saga.status == "compensated"

        await waiter(control_compensated, what="the control timed out and compensated")
        control = await orders.sagas.get(OrderSaga, "o-2")
        assert control is not None
        assert [t.kind for t in control.history if t.step == "ship"] == [
            "command-sent",
            "timed-out",
        ]
        # The loop judged o-1 in the same look (due order: the control's first).
        saga = await orders.sagas.get(OrderSaga, "o-1")
        assert saga is not None and saga.status == "running", saga
        assert not any(t.kind == "timed-out" for t in saga.history)
        await held.stuck.close()  # the member leaves: the reply goes back to the group

        async def ended() -> bool:
            saga = await orders.sagas.get(OrderSaga, "o-1")
            return saga is not None and saga.status in ("completed", "compensated")

        await waiter(ended)
        saga = await orders.sagas.get(OrderSaga, "o-1")
        assert saga is not None and saga.status == "completed"
        assert not any(t.kind == "timed-out" for t in saga.history)
    assert effects.of("o-1") == ["reserved", "charged"]  # nothing compensated


async def test_app_catch_up_limit_bounds_the_wait_for_a_held_reply(
    broker_name: str, tmp_path: Path, waiter: Wait
) -> None:
    """``App(catch_up_limit=1.0)``: the overdue timer waits for the held reply at most a
    second past the start, then the step times out (with the default 30 s it would wait)."""
    async with _a_reply_held_past_its_deadline(broker_name, tmp_path, waiter, Effects()) as held:
        async with App(
            "orders", broker=held.url, store=held.store, sagas=[OrderSaga], catch_up_limit=1.0
        ) as orders:
            started = time.monotonic()

            async def timed_out() -> bool:
                saga = await orders.sagas.get(OrderSaga, "o-1")
                return saga is not None and any(t.kind == "timed-out" for t in saga.history)

            await waiter(timed_out, timeout=10.0)
            assert time.monotonic() - started >= 0.9, "it waited for the backlog first"
        await held.stuck.close()


@pytest.mark.parametrize("limit", [0, -1.0, float("inf"), float("nan"), True, "30"])
def test_app_refuses_a_catch_up_limit_that_is_not_a_positive_duration(limit: object) -> None:
    with pytest.raises(ConfigurationError, match="catch_up_limit"):
        App("orders", sagas=[OrderSaga], catch_up_limit=limit)  # type: ignore[arg-type]
