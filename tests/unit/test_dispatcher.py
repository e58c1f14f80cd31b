"""The keyed dispatcher against a fake subscription: lanes, workers, the fetch window, and
what it gives back when a run ends."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import pytest

from eventflow.ports import Delivery
from eventflow.runtime.dispatch import Dispatcher, Handle
from eventflow.runtime.watchdog import Watch

Wait = Callable[..., Awaitable[None]]


class FakeDelivery:
    """A delivery that reports its ack and release to its subscription."""

    def __init__(self, sub: FakeSubscription, n: int, key: str | None) -> None:
        self.sub = sub
        self.n = n
        self.key = key
        self.topic = "t"
        self.payload = b""
        self.headers: Mapping[str, str] = {}
        self.delivery_count = 1
        self.metadata: Mapping[str, Any] = {}

    async def ack(self) -> None:
        self.sub.acked.append(self.n)

    async def nack(self, delay: float = 0.0) -> None:
        raise AssertionError("the dispatcher never nacks")

    async def release(self) -> None:
        self.sub.released.append(self.n)
        if self.sub.redeliver:
            self.sub.add([self])

    async def in_progress(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{self.key}:{self.n}>"


class FakeSubscription:
    """Hands out queued deliveries in order; records the fetch sizes asked for, the acks and
    the releases. With ``fail``, a fetch that finds the queue empty waits for ``fail_now``
    and raises it; with ``redeliver``, a released delivery is queued again."""

    pattern = "t"
    group = "g"

    def __init__(self, *, fail: Exception | None = None, redeliver: bool = False) -> None:
        self.queue: deque[FakeDelivery] = deque()
        self.fail = fail
        self.fail_now = asyncio.Event()
        self.redeliver = redeliver
        self.requests: list[int] = []
        self.fetched = 0
        self.acked: list[int] = []
        self.released: list[int] = []
        self.max_outstanding = 0
        self.closed = False
        self._more = asyncio.Event()

    def add(self, deliveries: Sequence[FakeDelivery]) -> None:
        self.queue.extend(deliveries)
        self._more.set()

    def make(self, keys: Sequence[str | None]) -> list[FakeDelivery]:
        """Queue one delivery per key, numbered in order."""
        start = self.fetched + len(self.queue)
        made = [FakeDelivery(self, start + i, key) for i, key in enumerate(keys)]
        self.add(made)
        return made

    @property
    def outstanding(self) -> int:
        """Fetched and neither acked nor released."""
        return self.fetched - len(self.acked) - len(self.released)

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[Delivery]:
        assert max_messages > 0, "fetch asked for nothing"
        self.requests.append(max_messages)
        if self.fail is not None and not self.queue:
            await self.fail_now.wait()
            raise self.fail
        while not self.queue:
            self._more.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._more.wait()
            except TimeoutError:
                return []
        batch = [self.queue.popleft() for _ in range(min(max_messages, len(self.queue)))]
        self.fetched += len(batch)
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        return batch  # type: ignore[return-value]

    async def close(self) -> None:
        self.closed = True


async def _given_back(deliveries: Sequence[Delivery], exc: Exception) -> None:
    for delivery in deliveries:
        await delivery.release()


def _dispatcher(
    sub: FakeSubscription,
    handle: Handle,
    *,
    concurrency: int,
    max_inflight: int = 64,
    grace_period: float = 5.0,
) -> Dispatcher:
    return Dispatcher(
        sub,  # type: ignore[arg-type]
        handle,
        _given_back,
        concurrency=concurrency,
        max_inflight=max_inflight,
        grace_period=grace_period,
        name="test",
    )


class Recorder:
    """A handler that records what runs and when, yielding a varying number of times so
    handlings of different lanes interleave, and acks."""

    def __init__(self) -> None:
        self.done: list[FakeDelivery] = []
        self.running: dict[str | None, int] = {}
        self.most_at_once = 0
        self.most_per_key = 0

    async def __call__(self, delivery: Delivery, watch: Watch) -> None:
        assert isinstance(delivery, FakeDelivery)
        key = delivery.key
        self.running[key] = self.running.get(key, 0) + 1
        self.most_per_key = max(self.most_per_key, self.running[key])
        self.most_at_once = max(self.most_at_once, sum(self.running.values()))
        for _ in range(delivery.n % 3 + 1):
            await asyncio.sleep(0)
        self.running[key] -= 1
        self.done.append(delivery)
        await delivery.ack()


def _per_key(deliveries: Sequence[FakeDelivery]) -> dict[str | None, list[int]]:
    out: dict[str | None, list[int]] = {}
    for d in deliveries:
        out.setdefault(d.key, []).append(d.n)
    return out


async def _run_until(dispatcher: Dispatcher, condition: Callable[[], bool], waiter: Wait) -> None:
    run = asyncio.create_task(dispatcher.run())
    try:
        await waiter(condition)
    finally:
        dispatcher.stop()
        async with asyncio.timeout(10):
            await run


async def test_one_worker_handles_in_fetch_order_so_each_key_in_order(waiter: Wait) -> None:
    sub = FakeSubscription()
    made = sub.make(["a", "b", "a", "c", "b", "a", None, "c"] * 5)
    handle = Recorder()
    await _run_until(
        _dispatcher(sub, handle, concurrency=1), lambda: len(handle.done) == 40, waiter
    )
    assert [d.n for d in handle.done] == [d.n for d in made]  # one lane: fetch order
    assert handle.most_at_once == 1
    assert sub.released == []


async def test_several_workers_keep_each_keys_order_and_run_keys_in_parallel(
    waiter: Wait,
) -> None:
    sub = FakeSubscription()
    made = sub.make([f"k{i % 4}" for i in range(80)])
    handle = Recorder()
    await _run_until(
        _dispatcher(sub, handle, concurrency=4), lambda: len(handle.done) == 80, waiter
    )
    assert _per_key(handle.done) == _per_key(made)  # publish order within each key
    assert handle.most_per_key == 1  # one key is never handled twice at once
    assert handle.most_at_once > 1  # different keys did run at the same time
    assert [d.n for d in handle.done] != [d.n for d in made]  # so not in fetch order


async def test_keyless_deliveries_each_get_a_lane_and_run_in_parallel(waiter: Wait) -> None:
    sub = FakeSubscription()
    sub.make([None] * 4)
    all_in = asyncio.Event()
    running: list[int] = []

    async def handle(delivery: Delivery, watch: Watch) -> None:
        assert isinstance(delivery, FakeDelivery)
        running.append(delivery.n)
        if len(running) == 4:
            all_in.set()
        await all_in.wait()  # returns only once all four run at the same time
        await delivery.ack()

    await _run_until(_dispatcher(sub, handle, concurrency=4), lambda: len(sub.acked) == 4, waiter)
    assert sorted(running) == [0, 1, 2, 3]


async def test_the_fetch_window_bounds_what_is_fetched_and_not_settled(waiter: Wait) -> None:
    sub = FakeSubscription()
    sub.make([None] * 40)
    gate = asyncio.Event()

    async def handle(delivery: Delivery, watch: Watch) -> None:
        await gate.wait()
        for _ in range(3):  # let the fetch task run between settlements
            await asyncio.sleep(0)
        await delivery.ack()

    dispatcher = _dispatcher(sub, handle, concurrency=2, max_inflight=6)
    run = asyncio.create_task(dispatcher.run())
    try:
        await waiter(lambda: sub.fetched == 6)  # the window fills while handlers block
        assert dispatcher.inflight == 6
        gate.set()
        await waiter(lambda: len(sub.acked) == 40)
    finally:
        dispatcher.stop()
        await run
    assert sub.max_outstanding == 6  # filled, never exceeded
    assert all(n <= 6 for n in sub.requests)
    assert len(sub.requests) > 40 // 6  # it had to come back for more


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_a_stop_releases_what_no_handler_started(concurrency: int, waiter: Wait) -> None:
    sub = FakeSubscription()
    sub.make(["a"] * 5 + ["b"] * 5 + ["c"] * 5)
    gate = asyncio.Event()
    started: list[int] = []

    async def handle(delivery: Delivery, watch: Watch) -> None:
        assert isinstance(delivery, FakeDelivery)
        started.append(delivery.n)
        await gate.wait()
        await delivery.ack()

    dispatcher = _dispatcher(sub, handle, concurrency=concurrency)
    run = asyncio.create_task(dispatcher.run())
    await waiter(lambda: sub.fetched == 15 and len(started) == concurrency)
    dispatcher.stop()
    gate.set()  # the started handlings finish within the grace period
    async with asyncio.timeout(10):
        await run
    assert sorted(sub.acked) == sorted(started)
    assert sorted(sub.released) == sorted(set(range(15)) - set(started))
    assert sub.outstanding == 0


async def test_a_handler_past_the_grace_period_is_cancelled_and_not_released(
    waiter: Wait,
) -> None:
    sub = FakeSubscription()
    sub.make(["a"] * 3)
    started = asyncio.Event()
    cancelled: list[int] = []

    async def handle(delivery: Delivery, watch: Watch) -> None:
        assert isinstance(delivery, FakeDelivery)
        started.set()
        try:
            await asyncio.Event().wait()  # never finishes by itself
        except asyncio.CancelledError:
            cancelled.append(delivery.n)
            raise

    dispatcher = _dispatcher(sub, handle, concurrency=1, grace_period=0.05)
    run = asyncio.create_task(dispatcher.run())
    await waiter(lambda: started.is_set() and sub.fetched == 3)
    dispatcher.stop()
    async with asyncio.timeout(10):
        await run
    assert cancelled == [0]
    assert sub.released == [1, 2]  # its attempt counts: redelivered by the broker, counted
    assert sub.acked == []


async def test_a_fetch_failure_ends_the_run_with_its_error_and_releases(waiter: Wait) -> None:
    sub = FakeSubscription(fail=ConnectionError("subscription lost"))
    sub.make(["a"] * 5)
    gate = asyncio.Event()
    started: list[int] = []

    async def handle(delivery: Delivery, watch: Watch) -> None:
        assert isinstance(delivery, FakeDelivery)
        started.append(delivery.n)
        await gate.wait()
        await delivery.ack()

    run = asyncio.create_task(_dispatcher(sub, handle, concurrency=1).run())
    await waiter(lambda: started == [0] and sub.fetched == 5)
    sub.fail_now.set()  # the next fetch raises
    await waiter(lambda: len(sub.requests) == 2)
    gate.set()
    with pytest.raises(ConnectionError, match="subscription lost"):
        async with asyncio.timeout(10):
            await run
    assert sub.acked == [0]  # the running handling finished
    assert sub.released == [1, 2, 3, 4]  # the rest was never started


async def test_a_failure_around_the_handler_gives_the_lane_back_in_order(waiter: Wait) -> None:
    sub = FakeSubscription(redeliver=True)
    made = sub.make(["a", "b", "a", "b", "a", "b"])
    handle = Recorder()
    failed: list[int] = []

    async def flaky(delivery: Delivery, watch: Watch) -> None:
        assert isinstance(delivery, FakeDelivery)
        if delivery.n == 2 and not failed:
            failed.append(delivery.n)
            raise ConnectionError("dedup store down (once)")
        await handle(delivery, watch)

    await _run_until(_dispatcher(sub, flaky, concurrency=2), lambda: len(handle.done) == 6, waiter)
    assert failed == [2]
    assert sub.released[:2] == [2, 4]  # the failed delivery first, then its lane behind it
    assert _per_key(handle.done) == _per_key(made)  # still in order per key
