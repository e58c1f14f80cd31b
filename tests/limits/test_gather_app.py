"""``ctx.gather`` in a handler of a running app (memory broker): ``limit_name=`` bounds the
calls by a declared limit, failures come back per call, and the handler's soft timeout
cancels every call it gathered."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

import pytest

from eventflow import (
    App,
    Breaker,
    CircuitOpenError,
    ConfigurationError,
    Context,
    Event,
    Gathered,
    Limit,
    RetryPolicy,
    subscribe,
)

Wait = Callable[..., Awaitable[None]]


class Order(Event, type="it.gather.order"):
    n: int
    lines: int


def once() -> RetryPolicy:
    return RetryPolicy(max_attempts=1, initial_delay=0.01, max_delay=0.02)


async def test_limit_name_bounds_the_calls_by_the_declared_limit(
    broker_url: str, waiter: Wait
) -> None:
    inside = peak = 0
    outcomes: dict[int, Gathered[int]] = {}

    async def reserve(line: int) -> int:
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        for _ in range(3):
            await asyncio.sleep(0)
        inside -= 1
        if line == 3:
            raise ValueError(f"line {line}: not enough stock")
        return line

    @subscribe("it.gather.order", group="gather-lim", concurrency=1, retry=once())
    async def handle(event: Order, ctx: Context) -> None:
        outcomes[event.n] = await ctx.gather(
            [functools.partial(reserve, line) for line in range(event.lines)],
            limit=10,
            limit_name="stock-api",
        )

    app = App(
        "gather-lim",
        broker=broker_url,
        handlers=[handle],
        limits=[Limit("stock-api", concurrency=3)],
    )
    async with app:
        await app.publish(Order(n=1, lines=12), key="o1")
        await waiter(lambda: 1 in outcomes, timeout=10)
        stats = app.stats()["limit:stock-api"]
    assert peak == 3  # the limit's 3, not gather's 10: reached and never passed
    assert stats["entered"] == 12 and stats["in_use"] == 0
    got = outcomes[1]
    assert [r.ok for r in got] == [line != 3 for line in range(12)]
    assert got.values == [line for line in range(12) if line != 3]


async def test_an_undeclared_limit_name_is_refused_before_any_call(
    broker_url: str, waiter: Wait
) -> None:
    began: list[int] = []
    errors: list[BaseException] = []

    async def call() -> None:
        began.append(1)

    @subscribe("it.gather.order", group="gather-unknown", retry=once())
    async def handle(event: Order, ctx: Context) -> None:
        try:
            await ctx.gather([call(), call()], limit_name="no-such-api")
        except ConfigurationError as exc:
            errors.append(exc)
        await ctx.gather([call()])  # a positive control: calls do run

    app = App("gather-unknown", broker=broker_url, handlers=[handle])
    async with app:
        await app.publish(Order(n=1, lines=1), key="o1")
        await waiter(lambda: app.consumers[0].stats.handled == 1, timeout=10)
    assert len(errors) == 1 and "no-such-api" in str(errors[0])
    assert began == [1]


async def test_an_open_breaker_comes_back_per_call_and_gives_the_message_back(
    broker_url: str, waiter: Wait
) -> None:
    attempts: list[int] = []
    refused: list[int] = []
    healthy = asyncio.Event()

    class Down(Exception):
        pass

    async def charge(line: int) -> int:
        if not healthy.is_set():
            raise Down(f"provider down for line {line}")
        return line

    @subscribe("it.gather.order", group="gather-brk", concurrency=1, retry=once())
    async def handle(event: Order, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        got = await ctx.gather(
            [functools.partial(charge, line) for line in range(event.lines)],
            limit=1,
            limit_name="pay",
        )
        refused.append(sum(isinstance(e, CircuitOpenError) for e in got.errors))
        got.raise_if_failed()  # CircuitOpenError first: the message is given back

    breaker = Breaker(failures=2, window=30.0, reset=0.2, on=(Down,))
    app = App(
        "gather-brk", broker=broker_url, handlers=[handle], limits=[Limit("pay", breaker=breaker)]
    )
    async with app:
        await app.publish(Order(n=1, lines=4), key="o1")
        consumer = app.consumers[0]
        await waiter(lambda: consumer.stats.limited >= 1, timeout=10)
        healthy.set()
        await waiter(lambda: consumer.stats.handled == 1, timeout=10)
        letters = await app.dead_letters.list()
    assert refused[0] >= 1  # the breaker opened among the calls of the first try
    assert letters == []  # retry=1: a spent attempt would have dead-lettered it
    assert set(attempts) == {1} and len(attempts) >= 2
    assert refused[-1] == 0


async def test_the_soft_timeout_cancels_every_gathered_call(broker_url: str, waiter: Wait) -> None:
    cancelled: list[int] = []
    running = 0
    all_running = asyncio.Event()

    async def hang(line: int) -> None:
        nonlocal running
        running += 1
        if running == 3:
            all_running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(line)
            raise

    @subscribe("it.gather.order", group="gather-cancel", retry=once(), timeout=0.3)
    async def handle(event: Order, ctx: Context) -> None:
        await ctx.gather([hang(line) for line in range(5)], limit=3)

    app = App("gather-cancel", broker=broker_url, handlers=[handle])
    async with app:
        await app.publish(Order(n=1, lines=5), key="o1")
        await waiter(lambda: app.consumers[0].stats.dead_lettered == 1, timeout=10)
        letters = await app.dead_letters.list()
    assert all_running.is_set()
    assert sorted(cancelled) == [0, 1, 2]  # the three running ones; two never began
    assert "HandlerTimeoutError" in letters[0].error


@pytest.mark.parametrize("limit", [0, -1, True, 2.5])
async def test_a_bad_limit_is_refused(limit: object) -> None:
    from eventflow.fanout import gather

    with pytest.raises(ConfigurationError, match="whole number"):
        await gather([], limit=limit)  # type: ignore[arg-type]
