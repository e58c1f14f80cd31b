"""App lifecycle: graceful shutdown and redelivery, signals, heartbeats, backpressure."""

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from eventflow import (
    App,
    BackpressureError,
    BrokerError,
    Context,
    Envelope,
    Event,
    StoreError,
    open_store,
    subscribe,
)
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig

Wait = Callable[..., Awaitable[None]]
PATTERN = "it.life.job"


class Job(Event, type="it.life.job"):
    n: int


# -- graceful shutdown -------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_in_flight_handler_finishes_and_the_rest_is_redelivered(
    concurrency: int, hub: MemoryBroker, broker_url: str, waiter: Wait
) -> None:
    gate = asyncio.Event()
    first_instance: list[int] = []

    @subscribe(PATTERN, group="workers", concurrency=concurrency)
    async def slow(event: Job) -> None:
        first_instance.append(event.n)
        await gate.wait()
        finished.append(event.n)

    finished: list[int] = []
    app1 = App("it-life", broker=broker_url, handlers=[slow], grace_period=30)
    await app1.start()
    for n in range(5):
        await app1.publish(Job(n=n), key="k")  # one key: only n=0 can be in flight
    await waiter(lambda: first_instance == [0])
    stopping = asyncio.create_task(app1.stop())
    # The stop has begun (its supervisor is gone) and waits for the in-flight handler: one
    # that did not wait would have cancelled it, and the handler would not finish below.
    await waiter(lambda: app1.health().status == "stopped", what="the stop to begin")
    assert not stopping.done()
    gate.set()
    await asyncio.wait_for(stopping, 10)

    assert first_instance == [0]
    assert finished == [0]  # the handler ran to its end during the stop
    assert hub.group_sizes()[("workers", PATTERN)] == 4  # n=0 acked, 1..4 left unacked

    second_instance: list[tuple[int, int]] = []

    # retry=1: a message that was fetched but never started is not a spent attempt.
    @subscribe(PATTERN, group="workers", retry=1)
    async def fast(event: Job, ctx: Context) -> None:
        second_instance.append((event.n, ctx.attempt))

    async with App("it-life", broker=broker_url, handlers=[fast]) as app2:
        await waiter(lambda: len(second_instance) == 4)
        assert await app2.dead_letters.list() == []
    assert second_instance == [(1, 1), (2, 1), (3, 1), (4, 1)]
    assert hub.group_sizes()[("workers", PATTERN)] == 0


async def _cancel_at_shutdown(
    concurrency: int, hub: MemoryBroker, broker_url: str, waiter: Wait
) -> list[tuple[int, int]]:
    """Run a handler that outlives the grace period, then a second instance of the group;
    return what the second instance handled as (n, ctx.attempt)."""
    started: list[int] = []
    cancelled: list[int] = []

    @subscribe(PATTERN, group="stuck", concurrency=concurrency, timeout=None)
    async def stuck(event: Job) -> None:
        started.append(event.n)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(event.n)
            raise

    app1 = App("it-life-stuck", broker=broker_url, handlers=[stuck], grace_period=0.1)
    await app1.start()
    for n in range(3):
        await app1.publish(Job(n=n), key="k")
    await waiter(lambda: started == [0])
    await asyncio.wait_for(app1.stop(), 10)
    assert started == cancelled == [0]
    assert hub.group_sizes()[("stuck", PATTERN)] == 3  # nothing acked

    redelivered: list[tuple[int, int]] = []

    @subscribe(PATTERN, group="stuck")
    async def done(event: Job, ctx: Context) -> None:
        redelivered.append((event.n, ctx.attempt))

    async with App("it-life-stuck", broker=broker_url, handlers=[done]):
        await waiter(lambda: len(redelivered) == 3)
    assert hub.group_sizes()[("stuck", PATTERN)] == 0
    return redelivered


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_handler_past_the_grace_period_is_cancelled_and_redelivered(
    concurrency: int, hub: MemoryBroker, broker_url: str, waiter: Wait
) -> None:
    redelivered = await _cancel_at_shutdown(concurrency, hub, broker_url, waiter)
    assert [n for n, _ in redelivered] == [0, 1, 2]  # in order, none lost
    assert [a for n, a in redelivered if n > 0] == [1, 1]  # never started: first attempts


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_a_handler_cancelled_at_shutdown_spends_no_attempt(
    concurrency: int, hub: MemoryBroker, broker_url: str, waiter: Wait
) -> None:
    # Attempts count handler failures; an interrupted handler did not fail (its unfinished
    # delivery counts towards max_deliveries, the crash-loop bound, instead).
    redelivered = await _cancel_at_shutdown(concurrency, hub, broker_url, waiter)
    assert redelivered[0] == (0, 1)


async def test_stop_is_idempotent_and_the_app_can_start_again(
    broker_url: str, waiter: Wait
) -> None:
    got: list[int] = []

    @subscribe(PATTERN, group="restart")
    async def handle(event: Job) -> None:
        got.append(event.n)

    app = App("it-life-restart", broker=broker_url, handlers=[handle])
    await app.start()
    await app.start()
    assert len(app.consumers) == 1
    await app.publish(Job(n=1))
    await waiter(lambda: got == [1])
    await app.stop()
    await app.stop()
    assert app.consumers == ()
    async with app:
        await app.publish(Job(n=2))
        await waiter(lambda: got == [1, 2])


async def test_publish_before_start_and_after_stop_raises(broker_url: str) -> None:
    app = App("it-life-early", broker=broker_url)
    with pytest.raises(BrokerError, match="not running"):
        await app.publish(Job(n=1))
    with pytest.raises(BrokerError, match="not started"):
        await app.broker.publish(PATTERN, b"x")
    async with app:
        await app.publish(Job(n=1))
    with pytest.raises(BrokerError):
        await app.publish(Job(n=2))


async def test_an_error_in_the_body_still_stops_the_app(broker_url: str) -> None:
    @subscribe(PATTERN, group="body-error")
    async def handle(event: Job) -> None: ...

    app = App("it-life-body", broker=broker_url, handlers=[handle])
    with pytest.raises(ZeroDivisionError):
        async with app:
            assert len(app.consumers) == 1
            1 / 0  # noqa: B018
    assert app.consumers == ()
    with pytest.raises(BrokerError):
        await app.publish(Job(n=1))


async def test_failed_start_cleans_up(broker_url: str, tmp_path: Path) -> None:
    @subscribe(PATTERN, group="bad-store")
    async def handle(event: Job) -> None: ...

    store = f"sqlite:///{tmp_path}/missing-dir/x.db"
    app = App("it-life-badstore", broker=broker_url, store=store, handlers=[handle])
    with pytest.raises(StoreError, match="cannot open SQLite database"):
        await app.start()
    assert app.consumers == ()
    with pytest.raises(BrokerError):
        await app.publish(Job(n=1))


# -- signals -----------------------------------------------------------------------------------


async def test_serve_stops_gracefully_on_sigterm(broker_url: str, waiter: Wait) -> None:
    gate = asyncio.Event()
    started: list[int] = []
    finished: list[int] = []

    @subscribe(PATTERN, group="served", timeout=None)
    async def handle(event: Job) -> None:
        started.append(event.n)
        await gate.wait()
        finished.append(event.n)

    app = App("it-life-serve", broker=broker_url, handlers=[handle], grace_period=30)
    before = signal.getsignal(signal.SIGTERM)
    emergency_stop = asyncio.Event()
    serving = asyncio.create_task(app.serve(emergency_stop))
    try:
        await waiter(lambda: len(app.consumers) == 1, what="the app to start")
        # serve() must have replaced the default action, or the kill would end pytest.
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        await app.publish(Job(n=1))
        await waiter(lambda: started == [1])
        os.kill(os.getpid(), signal.SIGTERM)
        # The signal began the stop; it drains the in-flight handler (``finished`` below).
        await waiter(lambda: app.health().status == "stopped", what="the stop to begin")
        assert not serving.done()
        gate.set()
        await asyncio.wait_for(serving, 10)
    finally:
        emergency_stop.set()
        gate.set()
        await asyncio.wait_for(serving, 10)
    assert finished == [1]
    assert app.consumers == ()
    assert signal.getsignal(signal.SIGTERM) == before  # handlers removed again


async def test_serve_returns_when_its_stop_event_is_set(broker_url: str, waiter: Wait) -> None:
    app = App("it-life-stop-event", broker=broker_url)
    stop = asyncio.Event()
    serving = asyncio.create_task(app.serve(stop))
    await waiter(lambda: _has_heartbeat(app), what="the app to start")
    assert not serving.done()
    stop.set()
    await asyncio.wait_for(serving, 10)
    assert await app.store.heartbeats.list() == []


async def _has_heartbeat(app: App) -> bool:
    return any(hb.instance == app.instance for hb in await app.store.heartbeats.list())


RUN_SCRIPT = textwrap.dedent(
    """
    import sys

    from eventflow import App, Envelope, subscribe


    @subscribe("it.life.sub", group="sub")
    async def handle(env: Envelope) -> None:
        pass


    App(
        "it-life-subprocess",
        broker="memory://",
        store=f"sqlite:///{sys.argv[1]}",
        handlers=[handle],
    ).run()
    print("clean exit", flush=True)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_run_in_a_process_stops_on_a_signal(
    signum: signal.Signals, tmp_path: Path, waiter: Wait
) -> None:
    script = tmp_path / "service.py"
    script.write_text(RUN_SCRIPT)
    db = tmp_path / "service.db"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        str(db),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with open_store(f"sqlite:///{db}") as store:

            async def alive() -> bool:
                assert proc.returncode is None, "the subprocess app exited early"
                return any(hb.app == "it-life-subprocess" for hb in await store.heartbeats.list())

            await waiter(alive, timeout=60, what="the subprocess app to heartbeat")
            (beat,) = await store.heartbeats.list()
            assert beat.pid == proc.pid
            assert beat.subscriptions == ("sub:it.life.sub",)
            proc.send_signal(signum)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            assert b"clean exit" in out
            assert await store.heartbeats.list() == []  # removed on clean shutdown
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.communicate()


# -- heartbeat ---------------------------------------------------------------------------------


async def test_heartbeat_present_while_running_and_removed_after(
    broker_url: str, waiter: Wait
) -> None:
    @subscribe(PATTERN, group="hb")
    async def handle(event: Job) -> None: ...

    @subscribe("it.life.other", group="hb2")
    async def other(env: Envelope) -> None: ...

    app = App("it-life-hb", broker=broker_url, handlers=[handle, other], heartbeat_interval=0.02)
    async with app:
        (first,) = await app.store.heartbeats.list()
        assert first.app == "it-life-hb"
        assert first.instance == app.instance
        assert first.pid == os.getpid()
        assert set(first.subscriptions) == {"hb:it.life.job", "hb2:it.life.other"}
        assert first.last_seen >= first.started_at
        assert first.started_at.utcoffset() is not None
        await app.publish(Job(n=1))

        async def refreshed() -> bool:
            (beat,) = await app.store.heartbeats.list()
            return beat.last_seen > first.last_seen and beat.stats.get("handled") == 1

        await waiter(refreshed, what="a later heartbeat with the handled count")
        (later,) = await app.store.heartbeats.list()
        assert later.started_at == first.started_at
    assert await app.store.heartbeats.list() == []


async def test_two_instances_have_separate_heartbeats(broker_url: str) -> None:
    from eventflow.adapters.memory import MemoryStore

    store = MemoryStore()
    a = App("it-life-pair", broker=broker_url, store=store)
    b = App("it-life-pair", broker=broker_url, store=store)
    assert a.instance != b.instance
    async with a, b:
        beats = await store.heartbeats.list()
        assert {hb.instance for hb in beats} == {a.instance, b.instance}
        await a.stop()
        assert [hb.instance for hb in await store.heartbeats.list()] == [b.instance]


# -- backpressure ------------------------------------------------------------------------------


async def test_backpressure_raises_when_no_consumer_keeps_up(
    broker_name: str, waiter: Wait
) -> None:
    broker = MemoryBroker(MemoryBrokerConfig(name=broker_name, max_pending=5, publish_timeout=0.1))
    gate = asyncio.Event()
    handled: list[int] = []

    @subscribe(PATTERN, group="slow")
    async def slow(event: Job) -> None:
        await gate.wait()
        handled.append(event.n)

    async with App("it-life-bp", broker=broker, handlers=[slow]) as app:
        for n in range(5):
            await app.publish(Job(n=n))
        with pytest.raises(BackpressureError) as info:
            await app.publish(Job(n=99))
        text = str(info.value)
        assert "'slow'" in text and "max_pending=5" in text
        assert broker.group_sizes()[("slow", PATTERN)] == 5  # bounded: nothing more queued
        gate.set()
        await waiter(lambda: len(handled) == 5)
        await app.publish(Job(n=6))  # the group drained, publishing works again
        await waiter(lambda: len(handled) == 6)
    assert sorted(handled) == [0, 1, 2, 3, 4, 6]


async def test_a_full_publisher_waits_for_space(broker_name: str, waiter: Wait) -> None:
    broker = MemoryBroker(MemoryBrokerConfig(name=broker_name, max_pending=2, publish_timeout=30))
    gate = asyncio.Event()
    handled: list[int] = []

    @subscribe(PATTERN, group="slow2")
    async def slow(event: Job) -> None:
        await gate.wait()
        handled.append(event.n)

    async with App("it-life-wait", broker=broker, handlers=[slow]) as app:
        await app.publish(Job(n=0))
        await app.publish(Job(n=1))
        blocked = asyncio.create_task(app.publish(Job(n=2)))
        # Positive control: a publish started after it (tasks start in order), to a topic
        # no group is full on, completes; the one to the full group is still waiting (not
        # failing and not queueing past the bound).
        control = asyncio.create_task(app.publish(Job(n=3), topic="it.life.elsewhere"))
        await waiter(control.done, what="the publish to a topic with room")
        assert not blocked.done()
        gate.set()
        await asyncio.wait_for(blocked, 10)
        await waiter(lambda: len(handled) == 3)


async def test_publishing_with_no_subscriber_is_not_backpressure(broker_name: str) -> None:
    broker = MemoryBroker(MemoryBrokerConfig(name=broker_name, max_pending=1, publish_timeout=0.05))
    async with App("it-life-nobody", broker=broker) as app:
        for n in range(10):
            await app.publish(Job(n=n))  # no group: nothing is kept
        assert broker.group_sizes() == {}
