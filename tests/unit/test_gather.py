"""``eventflow.fanout.gather`` (what ``ctx.gather`` runs): results in the order of the calls,
at most ``limit`` at once, failures kept per call, and cancellation reaching every call."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest

from eventflow import CircuitOpenError, ConfigurationError, Gathered, GatherResult, Reject
from eventflow.fanout import gather


async def test_results_keep_the_order_of_the_calls_not_of_finishing() -> None:
    n = 6
    finished: list[int] = []
    done = [asyncio.Event() for _ in range(n)]

    async def call(i: int) -> int:
        if i + 1 < n:
            await done[i + 1].wait()  # each call ends after the next one: last ends first
        finished.append(i)
        done[i].set()
        return i * 10

    results = await gather([call(i) for i in range(n)], limit=n)
    assert finished == list(reversed(range(n)))  # they did finish out of order
    assert [r.value for r in results] == [i * 10 for i in range(n)]
    assert results.ok and results.raise_if_failed() == [i * 10 for i in range(n)]
    assert len(results) == n and isinstance(results[0], GatherResult)


async def test_at_most_limit_calls_run_at_once() -> None:
    inside = peak = started = 0

    async def call(i: int) -> int:
        nonlocal inside, peak, started
        inside += 1
        started += 1
        peak = max(peak, inside)
        for _ in range(3):
            await asyncio.sleep(0)  # let the others run meanwhile
        inside -= 1
        return i

    results = await gather([functools.partial(call, i) for i in range(50)], limit=4)
    assert peak == 4  # reached (a positive control), never passed
    assert started == 50 and results.raise_if_failed() == list(range(50))


async def test_a_limit_above_the_calls_runs_them_all_at_once() -> None:
    inside = peak = 0
    gate = asyncio.Event()

    async def call() -> None:
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        if inside == 5:
            gate.set()
        await gate.wait()
        inside -= 1

    await gather([call for _ in range(5)], limit=100)
    assert peak == 5


async def test_failures_are_kept_per_call_and_the_others_go_on() -> None:
    async def call(i: int) -> int:
        await asyncio.sleep(0)
        if i % 3 == 1:
            raise ValueError(f"item {i} failed")
        return i

    results = await gather([call(i) for i in range(7)], limit=2)
    assert [r.ok for r in results] == [True, False, True, True, False, True, True]
    assert results.values == [0, 2, 3, 5, 6]
    assert [str(e) for e in results.errors] == ["item 1 failed", "item 4 failed"]
    assert not results.ok and repr(results) == "Gathered(5 ok, 2 failed)"
    with pytest.raises(ValueError, match="item 4 failed"):
        results[4].unwrap()
    assert results[0].unwrap() == 0
    with pytest.raises(ValueError, match="item 1 failed") as raised:
        results.raise_if_failed()  # the first failure in order, the others in its notes
    notes = raised.value.__notes__
    assert any("call 4 also failed: ValueError: item 4 failed" in n for n in notes)
    assert any("2 of 7 failed" in n for n in notes)


async def test_raise_if_failed_prefers_an_error_that_gives_the_message_back() -> None:
    async def rejected() -> None:
        raise Reject("card declined")

    async def refused() -> None:
        raise CircuitOpenError("payments-api", 0.0)

    results: Gathered[None] = await gather([rejected(), refused()], limit=2)
    with pytest.raises(CircuitOpenError):  # the dependency is down: no attempt spent
        results.raise_if_failed()
    only_rejected: Gathered[None] = await gather([rejected()], limit=2)
    with pytest.raises(Reject):
        only_rejected.raise_if_failed()


async def test_cancelling_the_caller_cancels_running_calls_and_closes_the_rest() -> None:
    running = 0
    all_running = asyncio.Event()
    cancelled: list[int] = []

    async def call(i: int) -> None:
        nonlocal running
        running += 1
        if running == 3:
            all_running.set()
        try:
            await asyncio.Event().wait()  # never ends by itself
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    coros: list[Coroutine[Any, Any, None]] = [call(i) for i in range(8)]
    task = asyncio.create_task(gather(coros, limit=3))
    await all_running.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cancelled) == [0, 1, 2]  # the three running calls were cancelled
    # the five never begun were closed: no "coroutine was never awaited" left behind
    assert all(inspect.getcoroutinestate(c) == inspect.CORO_CLOSED for c in coros)


async def test_a_call_cancelled_by_its_own_code_is_a_failure_of_that_call() -> None:
    async def self_cancelling() -> None:
        inner = asyncio.create_task(asyncio.sleep(10))
        inner.cancel()
        await inner  # raises CancelledError, not from the caller

    async def fine() -> int:
        return 1

    results = await gather([self_cancelling, fine], limit=1)
    assert not results[0].ok and isinstance(results[0].error, RuntimeError)
    assert isinstance(results[0].error.__cause__, asyncio.CancelledError)
    assert results[1].value == 1


async def test_take_is_entered_around_each_call() -> None:
    entered: list[str] = []

    @asynccontextmanager
    async def take() -> Any:
        entered.append("in")
        yield
        entered.append("out")

    async def call() -> int:
        entered.append("call")
        return 7

    results = await gather([call, call], limit=1, take=take)
    assert results.values == [7, 7]
    assert entered == ["in", "call", "out"] * 2


async def test_bad_arguments_are_refused_and_close_the_coroutines() -> None:
    async def call() -> None:
        return None

    coro = call()
    with pytest.raises(ConfigurationError, match="limit"):
        await gather([coro], limit=0)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
    coro = call()
    with pytest.raises(TypeError, match="call 1 is int"):
        await gather([coro, 3], limit=2)  # type: ignore[arg-type]
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
    assert len(await gather([], limit=3)) == 0
