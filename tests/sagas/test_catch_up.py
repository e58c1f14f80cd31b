"""The catch-up rule of overdue saga timers: a timer that came due while no instance ran
fires once the broker's backlog of the saga's group is 0 on every pattern (at most
``catch_up_limit`` after the start); with a broker that cannot tell (None), once every saga
consumer had an empty fetch. The fault tests show it with a killed NATS member."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from eventflow import App
from eventflow.adapters.memory.broker import MemoryBroker, MemoryBrokerConfig
from eventflow.errors import BrokerError, ConfigurationError
from eventflow.events import default_registry
from eventflow.ports import Subscription
from eventflow.sagas.persistence import TimerRow
from eventflow.sagas.runtime import SagaRuntime, Sagas
from eventflow.stores import store_for

from .shop import Effects, OrderPlaced, OrderSaga, OrderShipped, Script, participants

Wait = Callable[..., Awaitable[None]]


class FakeConsumer:
    """A saga consumer whose broker tells ``values`` (one per ask; the last repeats)."""

    def __init__(self, group: str, *values: int | Exception | None) -> None:
        self.group = group
        self.caught_up_at = 0.0
        self.values = list(values)
        self.asked = 0

    async def backlog(self) -> int | None:
        self.asked += 1
        value = self.values[0] if len(self.values) == 1 else self.values.pop(0)
        if isinstance(value, Exception):
            raise value
        return value


def _runtime(*consumers: FakeConsumer, limit: float = 30.0) -> SagaRuntime:
    sagas = Sagas(store_for("memory://"), default_registry, "test")
    runtime = SagaRuntime([OrderSaga], sagas, default_registry, catch_up_limit=limit)
    runtime.begin(consumers)
    return runtime


def _row(due: float) -> TimerRow:
    return TimerRow("saga-order-k", "step:ship", "order", "k", due, "t")


GROUP = f"saga.{OrderSaga.definition.name}"


async def _may_fire(runtime: SagaRuntime, due: float, now: float | None = None) -> bool:
    return await runtime.timers._may_fire(OrderSaga.definition, _row(due), now or time.time())


async def test_an_overdue_timer_waits_for_a_zero_backlog_on_every_pattern() -> None:
    held = FakeConsumer(GROUP, 1, 0)
    idle = FakeConsumer(GROUP, 0)
    other = FakeConsumer("billing", 7)  # not a saga group: not asked
    runtime = _runtime(held, idle, other)
    held.caught_up_at = idle.caught_up_at = time.time() + 1  # empty fetches do not decide
    start = runtime.timers._started_at
    now = start + 1.0
    assert not await _may_fire(runtime, start - 5, now)
    assert not await _may_fire(runtime, start - 5, now + 0.1)  # cached for 0.2 s
    assert held.asked == 1
    assert await _may_fire(runtime, start - 5, now + 0.3)
    assert held.asked == 2 and other.asked == 0


async def test_timers_due_after_the_start_and_past_the_limit_do_not_wait() -> None:
    held = FakeConsumer(GROUP, 3)
    runtime = _runtime(held, limit=5.0)
    start = runtime.timers._started_at
    assert await _may_fire(runtime, start + 0.5, start + 1)  # came due while running
    assert not await _may_fire(runtime, start - 1, start + 1)
    assert await _may_fire(runtime, start - 1, start + 5)  # catch_up_limit
    assert held.asked == 1


@pytest.mark.parametrize("answer", [None, BrokerError("down")])
async def test_a_broker_that_cannot_tell_leaves_the_empty_fetch_rule(
    answer: Exception | None,
) -> None:
    consumer = FakeConsumer(GROUP, answer)
    runtime = _runtime(consumer)
    start = runtime.timers._started_at
    assert not await _may_fire(runtime, start - 1, start + 1)
    consumer.caught_up_at = start + 0.5  # a fetch since the start found nothing left
    assert await _may_fire(runtime, start - 1, start + 1.5)


@dataclass(frozen=True)
class _Held:
    url: str  # the broker's
    store: str  # the saga app's
    stuck: Subscription  # the member of the saga's group that holds the reply


@asynccontextmanager
async def _a_reply_held_past_its_deadline(
    broker_name: str, tmp_path: Path, waiter: Wait, effects: Effects
) -> AsyncIterator[_Held]:
    """The saga process ran until its ship step's command went out, then stopped; the reply
    reached the broker before the step's deadline (1 s), but a member of the saga's group
    that no longer answers holds it (unacked: only a member's leaving gives it back); the
    deadline has passed. Yields where (:class:`_Held`), while the participants still run."""
    url, store = f"memory://{broker_name}", f"sqlite:///{tmp_path / 'sagas.db'}"
    hub = MemoryBroker(MemoryBrokerConfig(name=broker_name))  # keeps the hub's groups
    await hub.start()
    try:
        async with App(
            "shop", broker=url, handlers=participants(Script(never_ship={"o-1"}), effects)
        ) as shop:
            async with App("orders", broker=url, store=store, sagas=[OrderSaga]) as orders:
                await shop.publish(OrderPlaced(order_id="o-1"), key="o-1")

                async def shipping() -> bool:
                    saga = await orders.sagas.get(OrderSaga, "o-1")
                    return saga is not None and any(
                        t.kind == "command-sent" and t.step == "ship" for t in saga.history
                    )

                await waiter(shipping)
            group = f"saga.{OrderSaga.definition.name}"
            stuck = await hub.subscribe(OrderShipped.event_type, group=group)
            await shop.publish(OrderShipped(order_id="o-1"), key="o-1")
            held = await stuck.fetch(1, 5.0)
            assert len(held) == 1  # the reply, before the deadline, held and never acked
            assert (await hub.lag(OrderShipped.event_type, group=group)).messages == 1
            await asyncio.sleep(1.2)  # past the ship step's deadline (1 s)
            yield _Held(url, store, stuck)
    finally:
        await hub.close()


async def test_a_reply_held_by_a_stuck_member_wins_over_the_overdue_timeout(
    broker_name: str, tmp_path: Path, waiter: Wait
) -> None:
    """A reply held past its deadline (see the helper above): the saga process starts after
    the deadline, its fetches find nothing, yet the backlog is 1, so the timer waits, and
    once the member is gone the reply is handled and the saga completes."""
    effects = Effects()
    async with (
        _a_reply_held_past_its_deadline(broker_name, tmp_path, waiter, effects) as held,
        App("orders", broker=held.url, store=held.store, sagas=[OrderSaga]) as orders,
    ):
        # Several timer polls (0.5 s) with every fetch of the new process empty.
        await asyncio.sleep(1.5)
        saga = await orders.sagas.get(OrderSaga, "o-1")
        assert saga is not None and saga.status == "running", saga
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
