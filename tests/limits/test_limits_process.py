"""Process-scope limits and breakers on the memory broker: slots, rate, bounded waits that
give the message back without spending an attempt, and a breaker that pauses fetching."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from eventflow import (
    App,
    Breaker,
    CircuitOpenError,
    ConfigurationError,
    Context,
    Event,
    Limit,
    LimitTimeoutError,
    RetryPolicy,
    subscribe,
)
from eventflow.limits.breaker import Phase

Wait = Callable[..., Awaitable[None]]


class Call(Event, type="it.limits.call"):
    n: int


class Outage(Exception):
    """The dependency failing (the breaker counts it)."""


def fast(attempts: int) -> RetryPolicy:
    return RetryPolicy(max_attempts=attempts, initial_delay=0.01, max_delay=0.02)


async def test_concurrency_caps_blocks_inside_the_limit(broker_url: str, waiter: Wait) -> None:
    inside = peak = 0
    done: list[int] = []

    @subscribe("it.limits.call", group="cap", concurrency=8)
    async def handle(event: Call, ctx: Context) -> None:
        nonlocal inside, peak
        async with ctx.limit("api"):
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.01)
            inside -= 1
        done.append(event.n)

    app = App("lim-cap", broker=broker_url, handlers=[handle], limits=[Limit("api", concurrency=3)])
    async with app:
        for n in range(40):
            await app.publish(Call(n=n), key=f"k{n}")
        await waiter(lambda: len(done) == 40, timeout=30)
        stats = app.stats()["limit:api"]
    assert peak == 3  # reached (a positive control), never passed
    assert stats["entered"] == 40 and stats["in_use"] == 0


async def test_a_wait_past_the_timeout_gives_the_message_back_without_an_attempt(
    broker_url: str, waiter: Wait
) -> None:
    release = asyncio.Event()
    attempts: dict[int, list[int]] = {}

    @subscribe("it.limits.call", group="waits", concurrency=2, retry=fast(1))
    async def handle(event: Call, ctx: Context) -> None:
        attempts.setdefault(event.n, []).append(ctx.attempt)
        async with ctx.limit("api"):
            if event.n == 0:
                await release.wait()  # holds the only slot

    app = App(
        "lim-wait",
        broker=broker_url,
        handlers=[handle],
        limits=[Limit("api", concurrency=1, timeout=0.05)],
    )
    async with app:
        await app.publish(Call(n=0), key="a")
        await waiter(lambda: 0 in attempts)
        await app.publish(Call(n=1), key="b")
        consumer = app.consumers[0]
        await waiter(lambda: consumer.stats.limited >= 2, timeout=10)  # given back, again
        release.set()
        await waiter(lambda: consumer.stats.handled == 2, timeout=10)
        letters = await app.dead_letters.list()
        timed_out = app.stats()["limit:api"]["timed_out"]
    assert letters == []  # retry=1: a spent attempt would have dead-lettered it
    assert set(attempts[1]) == {1}  # every try of it was attempt 1
    assert len(attempts[1]) >= 3
    assert timed_out >= 2
    assert consumer.stats.retries == 0


async def test_rate_spaces_entries(broker_url: str, waiter: Wait) -> None:
    began: list[float] = []
    stamps: list[float] = []

    @subscribe("it.limits.call", group="rate", concurrency=4)
    async def handle(event: Call, ctx: Context) -> None:
        loop = asyncio.get_running_loop()
        began.append(loop.time())
        async with ctx.limit("api"):
            stamps.append(loop.time())

    app = App("lim-rate", broker=broker_url, handlers=[handle], limits=[Limit("api", rate=50.0)])
    async with app:
        for n in range(20):
            await app.publish(Call(n=n), key=f"k{n}")
        await waiter(lambda: len(stamps) == 20, timeout=30)
    # burst 1: the k-th token is taken at least k/50 s after the first, which is taken no
    # earlier than the first handling began. Each entry runs after its token (a sleep never
    # ends early), so the k-th entry runs at least k/50 s after that start. The first
    # entry's own stamp is no reference: a GC pause or the OS descheduling the process
    # between its token and its stamp delays it while the later tokens come due.
    start = min(began)
    early = [k for k, t in enumerate(sorted(stamps)) if t - start < k * 0.02 - 0.001]
    assert not early, f"entries before their token: {early}"


async def test_undeclared_names_and_bad_parameters_say_what_to_do() -> None:
    app = App("lim-names", limits=[Limit("api", concurrency=1)])
    with pytest.raises(ConfigurationError, match=r"no limit named 'pay'.*declared: 'api'"):
        app.limits.take("pay")
    with pytest.raises(ConfigurationError, match="before app 'lim-names' started"):
        app.limits.take("api")
    bad: list[Callable[[], object]] = [
        lambda: Limit("api"),
        lambda: Limit("api", concurrency=0),
        lambda: Limit("api", rate=-1),
        lambda: Limit("has space", concurrency=1),
        lambda: Limit("api", concurrency=1, backend="redis://x"),
        lambda: Limit("api", concurrency=1, scope="cluster", backend="http://x"),
        lambda: Limit("api", concurrency=1, scope="world"),  # type: ignore[arg-type]
        lambda: Limit("api", concurrency=1, breaker=5),  # type: ignore[arg-type]
        lambda: Breaker(failures=0),
        lambda: Breaker(on=("HTTPError",)),  # type: ignore[arg-type]
        lambda: Breaker(window=0),
        lambda: App("x", limits=[Limit("a", rate=1), Limit("a", rate=2)]),
        lambda: App("x", limits=[object()]),
    ]
    for make in bad:
        with pytest.raises(ConfigurationError):
            make()


async def test_a_cluster_limit_needs_a_shared_store(broker_url: str) -> None:
    app = App(
        "lim-mem",
        broker=broker_url,
        store="memory://",
        limits=[Limit("api", concurrency=1, scope="cluster")],
    )
    with pytest.raises(ConfigurationError, match="not shared by other processes"):
        await app.start()


async def test_an_open_breaker_pauses_fetching_spends_no_attempts_then_closes(
    broker_url: str, waiter: Wait
) -> None:
    down = True
    calls: list[tuple[int, int]] = []  # (n, attempt) of every call that reached the service
    handled: list[int] = []

    @subscribe("it.limits.call", group="brk", concurrency=2, retry=fast(3))
    async def handle(event: Call, ctx: Context) -> None:
        async with ctx.limit("api"):
            calls.append((event.n, ctx.attempt))
            if down:
                raise Outage("503")
        handled.append(event.n)

    breaker = Breaker(failures=3, window=30.0, reset=0.3, on=(Outage,))
    app = App(
        "lim-brk", broker=broker_url, handlers=[handle], limits=[Limit("api", breaker=breaker)]
    )
    async with app:
        for n in range(30):
            await app.publish(Call(n=n), key=f"k{n}")
        limiter = app.limits.limiter("api")
        assert limiter.cell is not None
        await waiter(lambda: limiter.cell.state.opened >= 1, timeout=10)  # type: ignore[union-attr]
        consumer = app.consumers[0]
        assert "breaker api OPEN" in " ".join(app.health().problems)
        assert app.health().status == "degraded"
        # While it is open and re-probed, fetching pauses: the broker keeps most messages.
        await waiter(lambda: limiter.cell.state.opened >= 3, timeout=10)  # type: ignore[union-attr]
        lag = await consumer.lag()
        assert lag.messages >= 20
        down = False
        await waiter(lambda: len(handled) == 30, timeout=30)
        state = limiter.cell.state  # type: ignore[union-attr]
        letters = await app.dead_letters.list()
        stats = app.stats()
    assert letters == []
    assert state.phase is Phase.CLOSED and state.closed >= 1
    assert stats["limit:api"]["refused"] + stats["brk:it.limits.call"]["limited"] > 0
    # No message spent more than its attempts: the calls counted while closed (attempt 1 or
    # 2) and probes (never counted) only; retry=3 would have dead-lettered on a third.
    assert max(attempt for _, attempt in calls) <= 2
    assert sorted(handled) == list(range(30))


async def test_circuit_open_error_is_raised_while_open() -> None:
    app = App(
        "lim-raise", limits=[Limit("api", breaker=Breaker(failures=1, reset=60, on=(Outage,)))]
    )
    async with app:
        with pytest.raises(CircuitOpenError) as opened:
            async with app.limits.take("api"):
                raise Outage("down")
        assert isinstance(opened.value.__cause__, Outage)
        with pytest.raises(CircuitOpenError, match="is open"):
            async with app.limits.take("api"):
                pytest.fail("entered an open breaker")
        with pytest.raises(LimitTimeoutError.__mro__[1]):  # GivenBack, both of them
            async with app.limits.take("api"):
                pass
