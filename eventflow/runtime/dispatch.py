"""The keyed dispatcher: one scheduler for every ``concurrency``.

One fetch task pulls deliveries while fewer than ``max_inflight`` are unsettled and files
them into lanes (after ``prepare``, if given, saw the batch: the pipeline's dedup lookup of
it); ``concurrency`` worker tasks each take a ready lane and handle its
deliveries one after the other, so one lane is handled in fetch order while different
lanes run in parallel. With several workers a lane is a key (keyless deliveries each get a
lane of their own): one key is handled in publish order, different keys concurrently.
With one worker every delivery goes in one lane, so deliveries are handled in the order
they were fetched (per-key lanes would only let one busy key hold back the others).

A handling that gives its delivery back to the broker for a later attempt (``RetryLater``)
returns True: the deliveries its lane holds behind it are given back too (``release``,
uncounted), so that the broker, which holds back the later messages of that key until the
delayed one is redelivered, keeps them in order; other lanes are not touched.

A handling that raises is a failure around the handler (the caller's handler settles its
own outcomes): the lane is given back, failed delivery first, to ``give_back`` (which
releases them and pauses), and the worker goes on. Other lanes keep running meanwhile.

A run ends when ``stop`` is called or ``fetch`` raises: the dispatcher stops fetching,
lets running handlings finish within the grace period (then cancels them), and gives back
(``release``) every fetched delivery no handling started, so it is not counted as an
attempt. The fetch error, if any, is raised from ``run``. Closing the subscription is the
caller's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ..ports import Delivery, Subscription
from .watchdog import Watch, Watchdog, unwatched

__all__ = ["Dispatcher", "GiveBack", "Handle", "Prepare"]

Handle = Callable[[Delivery, Watch], Awaitable[bool]]
"""Handles one delivery to its outcome, acking it, or gives it back to the broker for later
(returns True: what its lane holds behind it goes back too); raises on a failure around
the handler."""
GiveBack = Callable[[Sequence[Delivery], Exception], Awaitable[None]]
"""Gives deliveries back after a failure around the handler (release them, pause)."""
Prepare = Callable[[Sequence[Delivery]], Awaitable[None]]
"""Called with each fetched batch of two or more before it is filed (the pipeline's dedup
lookup of the whole batch); it handles its own errors."""


class Gate(Protocol):
    """Holds fetching while closed (a breaker the handlers met is open: limits.pause)."""

    @property
    def open(self) -> bool:
        """False while fetching must wait."""

    async def wait(self) -> None:
        """Return once fetching may go on."""


_log = logging.getLogger("eventflow.consumer")
_DRAIN_POLL = 0.01
_FETCH_WAIT = 1.0  # seconds a fetch waits for messages before it returns empty
_ONE_LANE = object()  # the lane of every delivery when one worker handles them all


class Dispatcher:
    """Runs ``handle`` over the deliveries of one subscription: lanes, workers, the fetch
    window. One dispatcher serves one run."""

    def __init__(
        self,
        subscription: Subscription,
        handle: Handle,
        give_back: GiveBack,
        *,
        concurrency: int,
        max_inflight: int,
        grace_period: float,
        name: str,
        watchdog: Watchdog | None = None,
        gate: Gate | None = None,
        prepare: Prepare | None = None,
    ) -> None:
        self._sub = subscription
        self._handle = handle
        self._give_back = give_back
        self._concurrency = concurrency
        self._limit = max_inflight
        self._grace_period = grace_period
        self._name = name
        self._watchdog = watchdog
        self._gate = gate
        self._prepare = prepare
        # A lane is a list, not a deque: most hold a message or two (a deque allocates a
        # 64-slot block for each), and none holds more than the fetch window.
        self._lanes: dict[object, list[Delivery]] = {}
        # Keys whose lane has work and no worker; never more than the unsettled deliveries.
        self._ready: deque[object] = deque()
        # Keys whose worker pauses after a failure around the handler (their lanes hold
        # nothing started): with `_ready`, what tells shutdown which deliveries no handling saw.
        self._pausing: set[object] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()  # idle workers
        self._inflight = 0  # fetched and not settled
        self._slot = asyncio.Event()  # set when the window has room again
        self._fetch_idle = False  # the fetch task waits for _slot (workers set it only then)
        self._active = 0  # handlings running, which shutdown waits for
        self._stopping = False  # no new handling
        self._stopped = asyncio.Event()
        self._fetch_error: Exception | None = None

    @property
    def inflight(self) -> int:
        """Deliveries fetched and not yet settled (handled or given back)."""
        return self._inflight

    def stop(self) -> None:
        """Stop fetching and starting handlings; ``run`` then drains and returns."""
        self._stopping = True
        self._stopped.set()

    async def run(self) -> None:
        """Fetch and handle until ``stop`` (return) or until ``fetch`` raises (raise its
        error); either way drain within the grace period and release what no handling
        started."""
        try:
            async with asyncio.TaskGroup() as tg:
                workers = [tg.create_task(self._worker()) for _ in range(self._concurrency)]
                fetcher = tg.create_task(self._fetch_loop())
                watchdog = self._watchdog
                timer = tg.create_task(watchdog.run()) if watchdog is not None else None
                await self._stopped.wait()
                fetcher.cancel()  # stop fetching at once; running handlings may finish
                await self._drain()
                for task in (*workers, timer):
                    if task is not None:
                        task.cancel()
        finally:
            await self._release_unstarted()
        if self._fetch_error is not None:
            raise self._fetch_error

    async def _drain(self) -> None:
        try:
            async with asyncio.timeout(self._grace_period):
                while self._active:  # noqa: ASYNC110 - polled only at shutdown
                    await asyncio.sleep(_DRAIN_POLL)
        except TimeoutError:
            _log.warning(
                "%s: handlers still running after the %.1fs grace period; cancelling "
                "them (their messages will be redelivered)",
                self._name,
                self._grace_period,
            )

    async def _fetch_loop(self) -> None:
        lanes, ready, slot = self._lanes, self._ready, self._slot
        keyed = self._concurrency > 1
        limit = self._limit
        refill = limit // 2
        while True:
            if self._inflight > refill:
                # Wait until half the window is free, then fetch a batch: one wake-up per
                # batch instead of one per settled message.
                slot.clear()
                self._fetch_idle = True
                try:
                    await slot.wait()
                finally:
                    self._fetch_idle = False
                continue
            gate = self._gate
            if gate is not None and not gate.open:
                await gate.wait()  # a breaker is open: the messages wait in the broker
                continue
            try:
                batch = await self._sub.fetch(limit - self._inflight, _FETCH_WAIT)
            except Exception as exc:
                # The subscription failed: end this run (drained like a stop), then raise.
                self._fetch_error = exc
                self.stop()
                return
            self._inflight += len(batch)
            prepare = self._prepare
            try:
                if prepare is not None and len(batch) > 1:
                    await prepare(batch)
            finally:  # filed even if cancelled meanwhile: released then as unstarted
                for delivery in batch:
                    key: object = _ONE_LANE
                    if keyed:
                        key = delivery.key if delivery.key is not None else delivery
                    lane = lanes.get(key)
                    if lane is None:
                        lanes[key] = [delivery]
                        ready.append(key)
                    else:
                        lane.append(delivery)
            if ready and self._waiters:
                self._wake_worker()

    def _wake_worker(self) -> None:
        """Wake one idle worker. One at a time: a woken worker that takes a lane wakes the
        next if more lanes are ready, so workers join as long as handlers yield, and a
        batch that one worker handles in one go costs one wake-up, not one per lane."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _worker(self) -> None:
        lanes, ready, waiters = self._lanes, self._ready, self._waiters
        refill = self._limit // 2
        watch = self._watchdog.watch() if self._watchdog is not None else unwatched()
        loop = asyncio.get_running_loop()
        while True:
            if not ready:
                waiter = loop.create_future()
                waiters.append(waiter)
                await waiter
                continue
            key = ready.popleft()
            if ready and waiters:
                self._wake_worker()  # the next lane goes to another worker meanwhile
            lane = lanes[key]
            while lane and not self._stopping:
                self._active += 1
                failure: Exception | None = None
                later = False
                try:
                    later = await self._handle(lane[0], watch)
                except Exception as exc:
                    failure = exc
                finally:
                    self._active -= 1  # a pause after a failure is not a running handling
                if failure is not None:
                    await self._lane_failed(key, lane, failure)
                    continue
                del lane[0]
                self._inflight -= 1
                if later and lane:
                    await self._give_back_behind(lane)
                if self._inflight <= refill and self._fetch_idle:
                    self._slot.set()
            if self._stopping:
                if lane:
                    ready.appendleft(key)  # not started: released as such at shutdown
                return
            del lanes[key]

    async def _lane_failed(self, key: object, lane: list[Delivery], exc: Exception) -> None:
        """A handling failed around its handler: give the lane back (its deliveries, in
        order), let ``give_back`` pause, and keep the lane for what is fetched meanwhile."""
        given = list(lane)
        lane.clear()
        self._inflight -= len(given)
        self._slot.set()
        # Left marked if cancelled here: at shutdown this lane holds nothing started (what
        # it fetched meanwhile is released as unstarted).
        self._pausing.add(key)
        await self._give_back(given, exc)
        self._pausing.discard(key)

    async def _give_back_behind(self, lane: list[Delivery]) -> None:
        """The lane's head went back to the broker with a delay: release what the lane held
        behind it (no handler saw those), so that none overtakes it."""
        given = list(lane)
        lane.clear()
        self._inflight -= len(given)
        for delivery in given:
            try:
                await delivery.release()
            except Exception as exc:  # the broker redelivers it anyway, counted
                _log.warning("%s: could not release a delivery: %s", self._name, exc)

    async def _release_unstarted(self) -> None:
        """Give back fetched deliveries no handling saw, so they are not counted as attempts."""
        unstarted: list[Delivery] = []
        waiting = {*self._ready, *self._pausing}
        for key, lane in self._lanes.items():
            # A lane no worker holds is all unstarted; a held one has its head started (its
            # worker was cancelled in the handler: that attempt counts).
            unstarted.extend(lane if key in waiting else itertools.islice(lane, 1, None))
        self._lanes.clear()
        self._ready.clear()
        for delivery in unstarted:
            try:
                await delivery.release()
            except Exception as exc:  # the broker redelivers it anyway, counted
                _log.warning("%s: could not release a delivery: %s", self._name, exc)
