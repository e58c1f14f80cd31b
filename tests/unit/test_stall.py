"""The stall guard's thread, in this process, with the process exit replaced by a recorder:
a blocked loop is logged with the blocking stack; a handler call past its hard timeout
(blocking the loop, or ignoring its cancellation) logs the stacks and "exits" with 70.
The real exit, in a child process on a real broker, is in tests/faults/test_hard_timeout.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import pytest

from eventflow import App, ConfigurationError
from eventflow.runtime.stall import HARD_TIMEOUT_EXIT_CODE, StallGuard
from eventflow.runtime.watchdog import Watch, Watchdog


def _block_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what the warning must point at


class _Exits:
    """Records the guard's exit instead of ending the process."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


async def test_a_blocked_loop_is_logged_with_the_blocking_stack(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="eventflow.watchdog")
    guard = StallGuard(0.5, name="app t")
    guard.start()
    try:
        await asyncio.sleep(0.3)  # a loop that answers: nothing to report yet
        assert guard.blocks == 0
        _block_the_loop(2.5)  # well past 0.5 s plus a tick or two
        for _ in range(100):  # let the loop answer the ping (bounded)
            await asyncio.sleep(0.01)
            if any("answers again" in r.getMessage() for r in caplog.records):
                break
    finally:
        guard.stop()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert guard.blocks == 1
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "has not answered" in text
    assert "_block_the_loop" in text and "time.sleep(seconds)" in text
    assert any("answers again" in r.getMessage() for r in caplog.records)


async def _run_watched(
    watchdog: Watchdog, call: Callable[[Watch], Awaitable[None]]
) -> tuple[asyncio.Task[None], asyncio.Task[None]]:
    """Start the watchdog's tick and a worker that enters one handler call running
    ``call`` (a coroutine function taking the watch)."""
    ticking = asyncio.create_task(watchdog.run())

    async def worker() -> None:
        watch = watchdog.watch()
        watch.enter()
        try:
            await call(watch)
        finally:
            watch.leave()

    return ticking, asyncio.create_task(worker())


async def test_a_handler_that_ignores_cancellation_ends_the_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exits = _Exits()
    guard = StallGuard(None, name="app t", exit=exits)
    watchdog = Watchdog(0.05, hard_timeout=0.3, guard=guard, name="shop.charge")
    cancelled: list[int] = []

    async def _stubborn_handler(watch: Watch) -> None:
        while not exits.done.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                cancelled.append(1)  # swallowed: the soft timeout cannot stop it

    guard.start()
    ticking, working = await _run_watched(watchdog, _stubborn_handler)
    try:
        await asyncio.wait_for(asyncio.to_thread(exits.done.wait, 30), 35)
        await working
    finally:
        ticking.cancel()
        working.cancel()
        await asyncio.gather(ticking, working, return_exceptions=True)
        guard.stop()
    assert exits.codes == [HARD_TIMEOUT_EXIT_CODE]
    assert cancelled  # the soft timeout tried first
    [record] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    text = record.getMessage()
    assert "shop.charge is still running" in text and "hard_timeout=0.3s" in text
    assert "_stubborn_handler" in text  # the handler's coroutine


async def test_a_handler_blocking_the_loop_ends_the_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exits = _Exits()
    guard = StallGuard(None, name="app t", exit=exits)
    watchdog = Watchdog(0.05, hard_timeout=0.3, guard=guard, name="shop.ship")

    async def _blocking_handler(watch: Watch) -> None:
        deadline = time.monotonic() + 30
        while not exits.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)  # noqa: ASYNC251 - a synchronous call: no tick of the loop runs

    guard.start()
    ticking, working = await _run_watched(watchdog, _blocking_handler)
    try:
        await working
    finally:
        ticking.cancel()
        await asyncio.gather(ticking, return_exceptions=True)
        guard.stop()
    assert exits.codes == [HARD_TIMEOUT_EXIT_CODE]
    [record] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    text = record.getMessage()
    assert "_blocking_handler" in text and "time.sleep(0.01)" in text  # the loop's stack


async def test_a_handler_within_its_hard_timeout_is_left_alone() -> None:
    """The positive control of the two above, and a registered watchdog is dropped when its
    run ends."""
    exits = _Exits()
    guard = StallGuard(None, name="app t", exit=exits)
    watchdog = Watchdog(1.0, hard_timeout=5.0, guard=guard, name="quick")

    async def quick(watch: Watch) -> None:
        await asyncio.sleep(0.2)

    guard.start()
    ticking, working = await _run_watched(watchdog, quick)
    try:
        await working
        assert guard._watchdogs == [watchdog]
    finally:
        ticking.cancel()
        await asyncio.gather(ticking, return_exceptions=True)
        guard.stop()
    assert exits.codes == []
    assert guard._watchdogs == []


def test_app_checks_loop_block_warning() -> None:
    assert App("t", loop_block_warning=None).loop_block_warning is None
    assert App("t", loop_block_warning=2).loop_block_warning == 2.0
    for bad in (0, -1, "1", True, float("inf")):
        with pytest.raises(ConfigurationError, match="loop_block_warning must be"):
            App("t", loop_block_warning=bad)  # type: ignore[arg-type]


async def test_a_blocked_loop_is_counted_in_the_apps_heartbeat(broker_url: str) -> None:
    """``eventflow status`` shows ``loop_blocks`` from the heartbeat's counters."""
    async with App(
        "stall-hb", broker=broker_url, loop_block_warning=0.5, heartbeat_interval=0.05
    ) as app:
        _block_the_loop(2.5)

        async def counted() -> bool:
            beats = await app.store.heartbeats.list()
            return any(b.stats.get("loop_blocks", 0) >= 1 for b in beats)

        for _ in range(300):  # bounded: the next beats carry the count
            if await counted():
                break
            await asyncio.sleep(0.01)
        assert await counted()
