"""Supervised components: a failing subscription is restarted and recovers, a component that
cannot recover fails the app visibly, and no failure cancels the caller's own task."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from eventflow import App, BrokerError, Context, Event, RetryPolicy, subscribe
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig
from eventflow.errors import ComponentFailedError
from eventflow.ports import Delivery, StartPosition, Subscription
from eventflow.supervision import ComponentState, RestartPolicy, Supervisor

Wait = Callable[..., Awaitable[None]]
FAST = RestartPolicy(initial_delay=0.01, max_delay=0.05, stable_after=0.3)


class Tick(Event, type="it.sup.tick"):
    """A test event."""

    n: int


class _FlakySubscription:
    """Delegates to a real subscription; ``fetch`` raises while the broker has faults left."""

    def __init__(self, broker: FlakyBroker, inner: Subscription) -> None:
        self._broker = broker
        self._inner = inner
        self.pattern = inner.pattern
        self.group = inner.group

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[Delivery]:
        if self._broker.faults:
            self._broker.faults -= 1
            self._broker.raised += 1
            raise self._broker.error
        return await self._inner.fetch(max_messages, timeout)

    async def close(self) -> None:
        await self._inner.close()


class FlakyBroker:
    """A memory broker whose subscriptions' ``fetch`` fails ``faults`` times (a network
    blip, a broker restart), raising ``error``."""

    def __init__(self, name: str, faults: int, error: Exception | None = None) -> None:
        self._inner = MemoryBroker(MemoryBrokerConfig(name=name))
        self.faults = faults
        self.raised = 0
        self.subscriptions = 0
        self.error = error or BrokerError("connection reset by the broker")
        self.url = self._inner.url

    def problems(self) -> tuple[str, ...]:
        return self._inner.problems()

    async def start(self, supervisor: Supervisor | None = None) -> None:
        await self._inner.start(supervisor)

    async def close(self) -> None:
        await self._inner.close()

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        await self._inner.publish(topic, payload, key=key, headers=headers)

    async def subscribe(
        self, pattern: str, *, group: str, start: StartPosition = "latest"
    ) -> Subscription:
        self.subscriptions += 1
        inner = await self._inner.subscribe(pattern, group=group, start=start)
        return _FlakySubscription(self, inner)


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_a_consumer_whose_fetch_fails_three_times_recovers_and_handles_everything(
    concurrency: int, broker_name: str, waiter: Wait
) -> None:
    handled: list[int] = []

    @subscribe("it.sup.tick", group="g", concurrency=concurrency, retry=1)
    async def handle(event: Tick) -> None:
        handled.append(event.n)

    broker = FlakyBroker(broker_name, faults=0)
    app = App("it-sup", broker=broker, handlers=[handle], restart_policy=FAST)
    async with app:
        for n in range(10):
            await app.publish(Tick(n=n), key=f"k{n % 3}")
        await waiter(lambda: len(handled) == 10, what="the first ten")
        broker.faults = 3
        for n in range(10, 30):
            await app.publish(Tick(n=n), key=f"k{n % 3}")
        await waiter(
            lambda: len(handled) == 30 and broker.raised == 3 and broker.subscriptions == 4,
            what="three failures, three new subscriptions, everything handled",
        )
        supervisor = app._supervisor
        assert supervisor is not None
        [component] = [c for c in supervisor.components if c.name.startswith("consumer")]
        assert component.restarts == 3
        assert broker.subscriptions == 4  # each run after a failure subscribes again
        assert app.failure is None
        await waiter(lambda: app.health().ok, what="healthy again once the run is stable")
        assert await app.dead_letters.list() == []
    assert sorted(handled) == list(range(30))
    for k in range(3):  # per-key order held across the restarts
        mine = [n for n in handled if n % 3 == k]
        assert mine == sorted(mine)


async def test_health_is_degraded_while_a_component_is_being_restarted(
    broker_name: str, waiter: Wait
) -> None:
    @subscribe("it.sup.tick", group="g")
    async def handle(event: Tick) -> None: ...

    broker = FlakyBroker(broker_name, faults=10**6)  # failing until told otherwise
    slow = RestartPolicy(initial_delay=0.05, max_delay=0.1, stable_after=0.3)
    app = App(
        "it-sup-deg", broker=broker, handlers=[handle], restart_policy=slow, heartbeat_interval=0.05
    )
    async with app:
        await waiter(lambda: broker.raised >= 2)
        health = app.health()
        assert health.status == "degraded"
        assert any("consumer g:it.sup.tick" in p and "BrokerError" in p for p in health.problems)
        await waiter(lambda: _beat_health(app) == "degraded", what="the heartbeat says degraded")
        broker.faults = 0
        await waiter(lambda: app.health().ok, what="ok once it ran stably")
        await waiter(lambda: _beat_health(app) == "ok", what="the heartbeat says ok again")


def _beat_health(app: App) -> str | None:
    beats: dict[str, Any] = app.store.heartbeats._beats  # type: ignore[attr-defined]
    beat = beats.get(app.instance)
    return None if beat is None else str(beat.health)


async def test_a_component_that_cannot_recover_fails_the_app_without_cancelling_the_caller(
    broker_name: str, waiter: Wait
) -> None:
    @subscribe("it.sup.tick", group="g")
    async def handle(event: Tick) -> None: ...

    # Not a transient error (a bug in an adapter, say): the consumer is not restarted.
    broker = FlakyBroker(broker_name, faults=1, error=RuntimeError("adapter bug"))
    app = App("it-sup-fail", broker=broker, handlers=[handle], restart_policy=FAST)
    body_finished = False
    with pytest.raises(ComponentFailedError) as info:
        async with app:
            await waiter(lambda: app.failure is not None, what="the consumer fails")
            # The caller's own awaits go on: nothing cancels this task.
            await asyncio.sleep(0.2)
            body_finished = True
    assert body_finished
    assert info.value.component == "consumer g:it.sup.tick"
    assert "adapter bug" in str(info.value) and "cannot recover" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert broker.subscriptions == 1  # never restarted


async def test_a_component_failing_past_give_up_after_stops_serve_with_its_error(
    broker_name: str,
) -> None:
    @subscribe("it.sup.tick", group="g")
    async def handle(event: Tick) -> None: ...

    broker = FlakyBroker(broker_name, faults=10**6)
    policy = RestartPolicy(initial_delay=0.01, max_delay=0.02, give_up_after=0.3)
    app = App("it-sup-giveup", broker=broker, handlers=[handle], restart_policy=policy)
    stop = asyncio.Event()  # never set: only the failure ends serve()
    with pytest.raises(ComponentFailedError, match="kept failing for"):
        await asyncio.wait_for(app.serve(stop, handle_signals=False), 10)
    assert broker.raised >= 2  # it was restarted until the budget ran out
    assert app.consumers == ()  # and the app stopped


class FaultyDedup:
    """A dedup store whose first ``seen`` calls (``failing_seen``) or first marks
    (``failing_marks``) fail like a dropped connection."""

    def __init__(self, *, failing_seen: int = 0, failing_marks: int = 0) -> None:
        self.failing_seen = failing_seen
        self.failing_marks = failing_marks
        self.marked: set[str] = set()

    async def seen(self, group: str, message_id: str) -> bool:
        if self.failing_seen:
            self.failing_seen -= 1
            raise OSError("connection reset by peer")
        return message_id in self.marked

    async def mark(self, group: str, message_id: str) -> None:
        await self.mark_new(group, message_id)

    async def mark_new(
        self, group: str, message_id: str, *, cancelled_by: str | None = None
    ) -> bool:
        if self.failing_marks:
            self.failing_marks -= 1
            raise OSError("the store went away")
        new = message_id not in self.marked
        self.marked.add(message_id)
        return new

    async def cancelled_by(self, group: str, message_id: str) -> str | None:
        return None

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None


async def test_retry_1_with_one_failing_dedup_lookup_still_runs_the_handler(
    broker_url: str, waiter: Wait
) -> None:
    attempts: list[int] = []

    @subscribe("it.sup.tick", group="g", retry=1)
    async def handle(event: Tick, ctx: Context) -> None:
        attempts.append(ctx.attempt)

    dedup = FaultyDedup(failing_seen=1)
    app = App("it-sup-dedup", broker=broker_url, handlers=[handle], dedup=dedup)
    async with app:
        await app.publish(Tick(n=1))
        await waiter(lambda: attempts == [1], what="the handler ran, at its first attempt")
        stats = app.stats()["g:it.sup.tick"]
        assert stats["given_back"] == 1
        assert stats["handled"] == 1
        assert await app.dead_letters.list() == []


async def test_a_failure_after_the_handler_gives_the_message_back_without_an_attempt(
    broker_url: str, waiter: Wait
) -> None:
    """The dedup mark fails once after a successful handler: the message is given back and
    handled again at attempt 1 (no attempt spent), not dead-lettered with retry=1."""
    attempts: list[int] = []

    @subscribe("it.sup.tick", group="g", retry=1)
    async def handle(event: Tick, ctx: Context) -> None:
        attempts.append(ctx.attempt)

    dedup = FaultyDedup(failing_marks=1)
    app = App("it-sup-mark", broker=broker_url, handlers=[handle], dedup=dedup)
    async with app:
        await app.publish(Tick(n=1))
        await waiter(lambda: app.stats()["g:it.sup.tick"]["handled"] == 1)
        assert attempts == [1, 1]
        assert await app.dead_letters.list() == []


async def test_a_handler_failure_is_recorded_so_a_redelivery_goes_on_from_it(
    broker_url: str, waiter: Wait, hub: MemoryBroker
) -> None:
    """Attempts live in the store's record, not in the broker's delivery count: a message
    whose first attempt failed, then given back before its second (the app stopped during
    the backoff), is handled at attempt 2 by the next instance."""
    attempts: list[int] = []
    gate = asyncio.Event()

    @subscribe("it.sup.tick", group="g", retry=RetryPolicy(3, initial_delay=30.0))
    async def fail_first(event: Tick, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        gate.set()
        raise ValueError("first attempt fails")

    store = "memory://"
    app = App("it-sup-rec", broker=broker_url, store=store, handlers=[fail_first], grace_period=0.1)
    await app.start()
    shared_store = app.store
    await app.publish(Tick(n=1))
    await gate.wait()
    await waiter(lambda: app.stats()["g:it.sup.tick"]["retries"] == 1)
    await app.stop()  # during the 30 s backoff: the message goes back, unacked

    got: list[int] = []

    @subscribe("it.sup.tick", group="g")
    async def succeed(event: Tick, ctx: Context) -> None:
        got.append(ctx.attempt)

    async with App("it-sup-rec", broker=broker_url, store=shared_store, handlers=[succeed]):
        await waiter(lambda: got == [2], what="the second attempt")
    assert attempts == [1]
    assert len(shared_store.attempts) == 0  # type: ignore[arg-type]  # cleared once handled


async def test_an_unreachable_broker_fails_start_within_its_connect_timeout() -> None:
    from eventflow.testing.services import free_port

    url = f"nats://127.0.0.1:{free_port()}?connect_timeout=1"
    app = App("it-sup-unreachable", broker=url)
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(BrokerError, match=r"127\.0\.0\.1"):
        async with app:
            pass
    assert loop.time() - began < 5
    assert app.health().status == "stopped"


async def test_give_backs_of_a_recorded_message_are_not_counted_as_a_crash_loop(
    broker_url: str, tmp_path: Path, waiter: Wait
) -> None:
    """A message whose first attempt failed (so it has a record) is then given back three
    times by failures around its handler: no process crashed, so with max_deliveries=3 it
    is still handled, not dead-lettered as a crash loop."""
    attempts: list[int] = []

    @subscribe("it.sup.tick", group="g", retry=RetryPolicy(3, initial_delay=0.01), max_deliveries=3)
    async def handle(event: Tick, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        if len(attempts) == 1:
            raise ValueError("the first attempt fails (and is recorded)")

    store = f"sqlite:///{tmp_path / 'sup.db'}"
    dedup = FaultyDedup(failing_marks=3)
    app = App("it-sup-gb", broker=broker_url, store=store, handlers=[handle], dedup=dedup)
    async with app:
        await app.publish(Tick(n=1))
        await waiter(lambda: app.stats()["g:it.sup.tick"]["handled"] == 1)
        assert await app.dead_letters.list() == []
        assert app.stats()["g:it.sup.tick"]["given_back"] == 3
    assert attempts == [1, 2, 2, 2, 2]  # every give-back ran attempt 2 again, none spent


class _GrowingBackoff(RestartPolicy):
    """Restarts quickly at first, then waits 9 s and more: what a subscription that keeps
    failing reaches (without the jitter, so the test knows how long it waits)."""

    def backoff(self, restart: int) -> float:
        return 0.01 * 30.0 ** (restart - 1)  # 0.01 s, 0.3 s, 9 s, 270 s, ...


async def test_stop_ends_a_consumer_waiting_in_its_restart_backoff_at_once(
    broker_name: str, waiter: Wait
) -> None:
    """A consumer whose subscription keeps failing waits longer and longer for its next
    restart; ``App.stop()`` ends that wait at once instead of sitting it out (or the grace
    period): it returns well within a second, against a 9 s backoff and a 5 s grace."""

    @subscribe("it.sup.tick", group="g")
    async def handle(event: Tick) -> None: ...

    broker = FlakyBroker(broker_name, faults=10**6)  # every fetch fails
    policy = _GrowingBackoff(initial_delay=0.01, max_delay=300.0, give_up_after=None)
    app = App(
        "it-sup-stop", broker=broker, handlers=[handle], restart_policy=policy, grace_period=5.0
    )
    await app.start()
    try:
        supervisor = app._supervisor
        assert supervisor is not None
        [component] = [c for c in supervisor.components if c.name.startswith("consumer")]
        await waiter(
            lambda: component.restarts == 3 and component.state is ComponentState.RETRYING,
            what="the consumer waiting for its third restart (9 s)",
        )
    finally:
        began = time.monotonic()
        await app.stop()
        took = time.monotonic() - began
    assert broker.raised == 3  # it did not run again meanwhile
    assert took < 1.0, f"stop took {took:.2f}s"
