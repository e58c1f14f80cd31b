"""The consumer loop of one subscription.

One fetch task pulls deliveries while fewer than ``max_inflight`` are unsettled and files
them into per-key lanes; ``concurrency`` worker tasks each take a ready lane and handle its
messages in order, so one key is handled in publish order while different keys run in
parallel. Keyless messages each get a lane of their own.

Handling one delivery: decode the envelope -> skip if the dedup store has its id -> decode
the typed event (upcast, validate) -> call the handler with a soft timeout, retrying with
backoff -> send what the handler published -> mark the id handled -> ack. Bad input and
exhausted retries go to the dead-letter store before the ack, so nothing is lost.

Attempts count handler failures only. A failure is recorded in the store's ``attempts``
before the next attempt, so a redelivery (after a crash) goes on from the right attempt;
a message handled at its first delivery writes nothing there. A redelivery whose handler
starts is recorded too: a message whose handlers keep being started and never finish (the
process dies on it) is dead-lettered after ``max_deliveries`` as a crash loop, while
messages a dying process had fetched but not started are charged nothing. A failure
around the handler (the dedup store, the commit, the broker's ack) is no attempt either:
the message is given back untouched (``release``) and the worker pauses, with a backoff of
its own.

A run ends when the consumer is asked to stop or its subscription fails (``fetch``
raises): it stops fetching, lets running handlers finish within the grace period (then
cancels them), gives back what it fetched and no handler started, and closes the
subscription so everything unacked is redelivered. After a failure the app's supervisor
starts a new run on a new subscription.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from .._logging import Throttled
from ..context import Context
from ..envelope import Envelope, _wire_fields, new_id
from ..errors import (
    AlreadyHandled,
    DecodeError,
    HandlerTimeoutError,
    MessageRefusedError,
    UnknownEventTypeError,
)
from ..events import EventRegistry
from ..ports import Attempts, DeadLetter, DeadLetterStore, DedupStore, Delivery, Subscription
from ..subscribe import HandlerSpec, Signature

if TYPE_CHECKING:
    from ..app import App

__all__ = ["TARGET_GROUP_HEADER", "Consumer", "ConsumerStats"]

TARGET_GROUP_HEADER = "eventflow-target-group"
"""Broker header naming the only group that should handle a message (dead-letter replay)."""

_log = logging.getLogger("eventflow.consumer")
_DRAIN_POLL = 0.01
_FAILURE_BACKOFF = 0.05
_FAILURE_BACKOFF_MAX = 5.0
_RECORDED_MAX = 10_000  # ids with an attempt record this process knows of (bounded)


class CrashLoopError(Exception):
    """A message whose handlers were started again and again without ever finishing."""

    reason = "crash-loop"


def _instant_methods(
    store: DedupStore,
) -> tuple[Callable[[str, str], bool] | None, Callable[[str, str], None] | None]:
    """``store``'s ``seen_nowait``/``mark_nowait`` (InstantDedupStore) if the consumer may call
    them instead of awaiting ``seen``/``mark``: plain methods defined by the same classes as
    ``seen`` and ``mark`` (a subclass overriding ``seen`` alone, a wrapper forwarding through
    ``__getattr__`` or an async mock keeps the awaited pair, so what it does is still done)."""
    cls = type(store)

    def owner(name: str) -> type | None:
        return next((k for k in cls.__mro__ if name in k.__dict__), None)

    pairs = (("seen", "seen_nowait"), ("mark", "mark_nowait"))
    for awaited, instant in pairs:
        method = getattr(cls, instant, None)
        if (
            method is None
            or inspect.iscoroutinefunction(method)
            or owner(awaited) is not owner(instant)
        ):
            return None, None
    return store.seen_nowait, store.mark_nowait  # type: ignore[attr-defined]


class _Watch:
    """What the watchdog knows of one worker task: the handler call it is in, if any.

    ``calls`` goes up by one as a handler call starts and by one as it ends (odd: in a
    handler), so a worker marks its calls with two increments and no clock read; the
    watchdog times a call from the tick that first sees it.
    """

    __slots__ = ("calls", "cancels_before", "expired", "seen", "seen_at", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.calls = 0
        self.expired = False  # the watchdog cancelled the current call
        # The task's cancel requests when the watchdog cancelled it: a handler's task group
        # may have left one counted for good (Python 3.11), so "ours" is one more than that.
        self.cancels_before = 0
        self.seen = 0  # the call the watchdog is timing (0: none)
        self.seen_at = 0.0


@dataclass(slots=True)
class ConsumerStats:
    """Counters of one consumer since it started."""

    received: int = 0
    handled: int = 0
    duplicates: int = 0
    retries: int = 0
    dead_lettered: int = 0
    dropped: int = 0
    given_back: int = 0
    """Messages given back untouched after a failure around the handler (no attempt spent)."""
    redelivered: int = 0
    """Deliveries after one that ended without an outcome (a crash, a stop past the grace)."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return asdict(self)


class Consumer:
    """Runs one ``@subscribe`` handler for one group over one broker subscription."""

    def __init__(
        self,
        app: App,
        spec: HandlerSpec,
        group: str,
        signature: Signature,
        registry: EventRegistry,
        dedup: DedupStore,
        dead_letters: DeadLetterStore,
        attempts: Attempts,
        *,
        grace_period: float,
        max_inflight: int | None = None,
    ) -> None:
        self.app = app
        self.spec = spec
        self.group = group
        self.signature = signature
        self.registry = registry
        self.dedup = dedup
        self.dead_letters = dead_letters
        self.attempts = attempts
        self.grace_period = grace_period
        self.max_inflight = max_inflight or max(64, spec.concurrency * 16)
        self.stats = ConsumerStats()
        self._sub: Subscription | None = None
        self._stop_requested = False
        self._log = Throttled(_log)
        # Ids whose attempt record this process wrote (bounded, oldest forgotten first): a
        # delivery of one of them reads its record even when the broker counts it as a
        # first delivery (it was given back untouched after its failures were recorded).
        self._recorded: dict[str, None] = {}
        # Ids this consumer gave back after reading their record (bounded likewise): their
        # next delivery is not a crash's, so it counts no start.
        self._gave_back: dict[str, None] = {}
        self._failures = 0  # infrastructure failures in a row (reset by a handled message)
        self._begin_run()
        # type -> (version, validator) of the handler's event classes: the common case (the
        # message is at the class's version) validates without the registry's generic path.
        self._validators: dict[str, tuple[int, Callable[[Any], Any]]] = {
            t: (cls.event_version, cls.__pydantic_validator__.validate_python)
            for t, cls in (signature.accepts or {}).items()
        }
        # What handling reads per message and never changes, unpacked in one step.
        self._hot = (
            self.stats,
            spec,
            group,
            spec.idempotent,
            self._guard_ids,
            self._validators,
            spec.retry,
            spec.fn,
            spec.timeout,
            signature.takes_context,
            app,
        )

    def _begin_run(self) -> None:
        """The state of one run (a run after a failure starts afresh)."""
        # A lane is a list, not a deque: most hold a message or two (a deque allocates a
        # 64-slot block for each), and none holds more than the fetch window.
        self._lanes: dict[object, list[Delivery]] = {}
        self._ready: deque[object] = deque()
        # Keys whose worker pauses after an infrastructure failure (their lanes hold nothing
        # started): with `_ready`, what tells shutdown which fetched deliveries no handler saw.
        self._pausing: set[object] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._inflight = 0
        self._slot = asyncio.Event()
        self._fetch_idle = False  # the fetch task waits for _slot (workers set it only then)
        self._active = 0
        # The serial loop's fetched batch; from index _batch_from on, not yet started.
        self._batch: Sequence[Delivery] = ()
        self._batch_from = 0
        # envelope id -> the handling in progress (concurrency > 1 only), so a duplicate
        # fetched while the original runs waits for its outcome: None until a duplicate
        # arrives and makes the future it waits on (one future per duplicate, not per message).
        self._handling: dict[str, asyncio.Future[None] | None] = {}
        self._guard_ids = self.spec.idempotent and self.spec.concurrency > 1
        self._stopping = self._stop_requested  # no new handling in this run
        self._stopped = asyncio.Event()
        if self._stop_requested:
            self._stopped.set()
        self._fetch_error: Exception | None = None
        self._watches: list[_Watch] = []  # one per worker task

    @property
    def name(self) -> str:
        """``group:pattern`` — how status and logs name this consumer."""
        return f"{self.group}:{self.spec.pattern}"

    async def subscribe(self) -> None:
        """Join the group; after this returns, new messages reach this consumer."""
        self._sub = await self.app.broker.subscribe(self.spec.pattern, group=self.group)

    def stop(self) -> None:
        """Ask the consumer to stop fetching and drain; ``run`` then returns."""
        self._stop_requested = True
        self._stopping = True
        self._stopped.set()

    async def run(self) -> None:
        """One run: fetch and handle until ``stop`` (return) or until the subscription fails
        (raise its error); either way drain within the grace period and close the
        subscription. A run after a failure subscribes again."""
        if self._stop_requested:
            return
        sub = self._sub
        if sub is None:
            await self.subscribe()
            sub = self._sub
            assert sub is not None
        self._begin_run()
        try:
            async with asyncio.TaskGroup() as tg:
                fetcher: asyncio.Task[None] | None = None
                if self.spec.concurrency == 1:
                    # One worker handles deliveries in fetch order, which is key order.
                    workers = [tg.create_task(self._serial_loop(sub))]
                else:
                    workers = [tg.create_task(self._worker()) for _ in range(self.spec.concurrency)]
                    fetcher = tg.create_task(self._fetch_loop(sub))
                    workers.append(fetcher)
                watchdog = None
                if self.spec.timeout is not None:
                    watchdog = tg.create_task(self._watchdog(self.spec.timeout))
                await self._stopped.wait()
                if fetcher is not None:
                    fetcher.cancel()  # stop fetching at once; running handlers may finish
                try:
                    async with asyncio.timeout(self.grace_period):
                        while self._active:  # noqa: ASYNC110 - polled only at shutdown
                            await asyncio.sleep(_DRAIN_POLL)
                except TimeoutError:
                    _log.warning(
                        "%s: handlers still running after the %.1fs grace period; cancelling "
                        "them (their messages will be redelivered)",
                        self.name,
                        self.grace_period,
                    )
                for worker in workers:
                    worker.cancel()
                if watchdog is not None:
                    watchdog.cancel()
        finally:
            self._sub = None
            try:
                await self._release_unstarted()
            finally:
                await sub.close()
        if self._fetch_error is not None:
            raise self._fetch_error

    def _fetch_failed(self, exc: Exception) -> None:
        """The subscription failed: end this run (drained like a stop), then raise ``exc``."""
        self._fetch_error = exc
        self._stopping = True
        self._stopped.set()

    @property
    def dedup(self) -> DedupStore:
        """The dedup store of this consumer's idempotent handling."""
        return self._dedup

    @dedup.setter
    def dedup(self, store: DedupStore) -> None:
        self._dedup = store
        self._seen_nowait, self._mark_nowait = _instant_methods(store)

    async def _release_unstarted(self) -> None:
        """Give back fetched deliveries no handler saw, so they are not counted as attempts."""
        unstarted = list(self._batch[self._batch_from :])
        waiting = {*self._ready, *self._pausing}
        for key, lane in self._lanes.items():
            # A lane no worker holds is all unstarted; a held one has its head started (its
            # worker was cancelled in the handler: that attempt counts).
            unstarted.extend(lane if key in waiting else itertools.islice(lane, 1, None))
        self._batch = ()
        self._lanes.clear()
        for delivery in unstarted:
            try:
                await delivery.release()
            except Exception as exc:  # the broker redelivers it anyway, counted
                _log.warning("%s: could not release a delivery: %s", self.name, exc)

    def _watch(self) -> _Watch:
        """The current worker task's watch, known to the watchdog."""
        task = asyncio.current_task()
        assert task is not None
        watch = _Watch(task)
        self._watches.append(watch)
        return watch

    async def _serial_loop(self, sub: Subscription) -> None:
        watch = self._watch()
        handle = self._process
        limit = self.max_inflight
        while not self._stopping:
            try:
                batch = self._batch = await sub.fetch(limit, 1.0)
            except Exception as exc:
                self._fetch_failed(exc)
                return
            for pos, delivery in enumerate(batch):
                if self._stopping:
                    self._batch_from = pos  # never started: released at shutdown
                    return
                self._batch_from = pos + 1
                try:
                    await handle(delivery, watch)
                except Exception as exc:
                    # The store or broker failed around the handler: give this delivery
                    # and the rest of the batch back (keeping key order), pause, go on.
                    self._batch = ()
                    await self._infrastructure_failure(delivery, batch[pos + 1 :], exc)
                    break
            self._batch = ()

    async def _fetch_loop(self, sub: Subscription) -> None:
        lanes, ready, slot, waiters = self._lanes, self._ready, self._slot, self._waiters
        limit = self.max_inflight
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
            try:
                batch = await sub.fetch(limit - self._inflight, 1.0)
            except Exception as exc:
                self._fetch_failed(exc)
                return
            self._inflight += len(batch)
            for delivery in batch:
                key: object = delivery.key if delivery.key is not None else delivery
                lane = lanes.get(key)
                if lane is None:
                    lanes[key] = [delivery]
                    ready.append(key)
                else:
                    lane.append(delivery)
            if ready and waiters:
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
        # `ready` holds keys whose lane has work and no worker; it never holds more keys than
        # there are unsettled deliveries, so the fetch window bounds it.
        lanes, ready, slot, waiters = self._lanes, self._ready, self._slot, self._waiters
        refill = self.max_inflight // 2
        wake = self._wake_worker
        watch = self._watch()
        handle = self._process
        loop = asyncio.get_running_loop()
        while True:
            if not ready:
                waiter = loop.create_future()
                waiters.append(waiter)
                await waiter
                continue
            key = ready.popleft()
            if ready and waiters:
                wake()  # the next lane goes to another worker while this one handles
            lane = lanes[key]
            while lane and not self._stopping:
                try:
                    await handle(lane[0], watch)
                except Exception as exc:
                    # The store or broker failed around the handler: give the lane back
                    # (this key's messages, in order), pause, go on with other keys.
                    failed, *rest = lane
                    lane.clear()
                    self._inflight -= 1 + len(rest)
                    slot.set()
                    # Left marked if cancelled here: at shutdown this lane holds nothing
                    # started (what it fetched meanwhile is released as unstarted).
                    self._pausing.add(key)
                    await self._infrastructure_failure(failed, rest, exc)
                    self._pausing.discard(key)
                    continue
                del lane[0]
                self._inflight -= 1
                if self._inflight <= refill and self._fetch_idle:
                    slot.set()
            if self._stopping:
                if lane:
                    ready.appendleft(key)  # not started: released as such at shutdown
                return
            del lanes[key]

    async def _infrastructure_failure(
        self, failed: Delivery, rest: Sequence[Delivery], exc: Exception
    ) -> None:
        """Survive a failure around the handler (dedup store, commit, dead-letter store,
        broker ack): no attempt of the message is spent. Give it back untouched with the ones
        fetched behind it (key order), pause with a backoff of its own, and go on."""
        self._failures += 1
        self.stats.given_back += 1
        delay = min(_FAILURE_BACKOFF_MAX, _FAILURE_BACKOFF * 2 ** min(self._failures, 8))
        self._log.error(
            "infrastructure",
            "%s: infrastructure error around a handler (%s: %s); the message is given back "
            "without spending an attempt, pausing %.1fs",
            self.name,
            type(exc).__name__,
            exc,
            delay,
        )
        for delivery in (failed, *rest):
            try:
                await delivery.release()
            except Exception as give_back_error:  # the broker redelivers it anyway
                _log.warning("%s: could not give a delivery back: %s", self.name, give_back_error)
        await asyncio.sleep(delay)

    async def _watchdog(self, timeout: float) -> None:
        """Cancel handlers that run past ``timeout``: one timer per consumer, not per message.

        Checked every ``timeout / 20`` (5 ms to 1 s). A call is timed from the first tick
        that sees it, so it is never cancelled early, and while ticks come on time (nothing
        blocks the loop) at most two ticks late: a tenth of a timeout of 0.1 s or more.
        """
        tick = min(max(timeout / 20, 0.005), 1.0)
        clock = asyncio.get_running_loop().time  # a loop may keep its own time
        watches = self._watches
        while True:
            await asyncio.sleep(tick)
            now = clock()
            for watch in watches:
                calls = watch.calls
                if not calls & 1:
                    continue  # not in a handler
                if calls != watch.seen:
                    watch.seen, watch.seen_at = calls, now
                elif now - watch.seen_at >= timeout and not watch.expired:
                    watch.expired = True
                    watch.cancels_before = watch.task.cancelling()
                    watch.task.cancel()

    # -- one delivery ------------------------------------------------------------------------

    async def _process(self, delivery: Delivery, watch: _Watch) -> None:
        # `_active` counts running handlers so shutdown can wait for them to finish.
        self._active += 1
        guarded = tracked = False
        try:
            (
                stats,
                spec,
                group,
                idempotent,
                guard_ids,
                validators,
                policy,
                fn,
                timeout,
                takes_ctx,
                app,
            ) = self._hot
            stats.received += 1
            headers = delivery.headers
            if headers:
                target = headers.get(TARGET_GROUP_HEADER)
                if target is not None and target != group:
                    await delivery.ack()  # a replay meant for another group
                    return
            # The checked wire fields: the Envelope itself is built only if something
            # reads it (most handlings never do).
            try:
                fields = _wire_fields(delivery.payload)
            except DecodeError as exc:
                await self._dead_letter(delivery, None, exc, attempts=0)
                return
            env_id: str = fields["id"]
            if guard_ids:
                # Two copies of one message in flight at once (a republish without a key):
                # the second waits for the first's outcome, then finds it in the dedup store.
                handling = self._handling
                while env_id in handling:
                    busy = handling[env_id]
                    if busy is None:
                        busy = handling[env_id] = asyncio.get_running_loop().create_future()
                    await asyncio.shield(busy)
                handling[env_id] = None
                guarded = True
            if idempotent:
                seen_nowait = self._seen_nowait
                if (
                    seen_nowait(group, env_id)
                    if seen_nowait is not None
                    else await self.dedup.seen(group, env_id)
                ):
                    stats.duplicates += 1
                    await delivery.ack()
                    if delivery.delivery_count > 1 or env_id in self._recorded:
                        # Handled, then the process stopped before it forgot the record.
                        await self._forget(env_id)
                    return
            fast = validators.get(fields["type"])
            env: Envelope | None = None
            try:
                if fast is not None and fast[0] == fields["version"]:
                    try:
                        arg = fast[1](fields["data"])
                    except ValidationError:
                        env, arg = self._decode(fields)  # raises the descriptive error
                else:
                    env, arg = self._decode(fields)
            except Exception as exc:  # DecodeError, or a validator raising something else
                await self._dead_letter(delivery, env_id, exc, attempts=0)
                return
            attempt = 0  # handler attempts that failed before this one
            tracked = delivery.delivery_count > 1 or env_id in self._recorded
            if tracked:
                # Not the first delivery (or given back after a recorded failure): the record
                # tells which attempt this is, and how often handlers were started without
                # ever finishing. A start is counted for a delivery after one that ended
                # without an outcome (a crash), not after this consumer gave it back itself.
                attempts = self.attempts
                given_back_here = env_id in self._gave_back
                if given_back_here:
                    del self._gave_back[env_id]
                if delivery.delivery_count > 1 and not given_back_here:
                    stats.redelivered += 1
                    record = await attempts.started(group, env_id)
                else:
                    record = await attempts.get(group, env_id)
                self._note_recorded(env_id)
                unfinished = 1 + record.starts if attempts.durable else delivery.delivery_count - 1
                if unfinished >= spec.max_deliveries:
                    await self._dead_letter(
                        delivery,
                        env_id,
                        CrashLoopError(
                            f"its handler was started {unfinished} times and never finished "
                            f"(max_deliveries={spec.max_deliveries}): it looks like a crash "
                            "loop, the process stopping (killed, out of memory, hard timeout) "
                            "while it handles this message; inspect it before replaying"
                        ),
                        attempts=record.failures + unfinished,
                    )
                    await self._forget(env_id)
                    return
                attempt = record.failures
            while True:
                attempt += 1
                ctx = Context._of_fields(app, fields, env, group, attempt)
                error: BaseException | None = None
                if timeout is not None:
                    watch.calls += 1  # odd: in a handler
                try:
                    await (fn(arg, ctx) if takes_ctx else fn(arg))
                except asyncio.CancelledError as exc:
                    # Ours (the watchdog's) only if taking its request back leaves none:
                    # a shutdown cancel arriving at the same time must still stop us.
                    timed_out = (
                        watch.expired and watch.task.cancelling() <= watch.cancels_before + 1
                    )
                    if not timed_out:
                        if ctx._tx is not None:
                            await self._roll_back(ctx, exc)
                        raise  # shutdown, not our timeout: no attempt spent
                    error = HandlerTimeoutError(
                        f"handler {spec.name} ran past its {timeout}s timeout"
                    )
                except Exception as exc:
                    error = exc
                finally:
                    if timeout is not None:
                        watch.calls += 1
                        if watch.expired:  # the watchdog fired; take its cancel request back
                            watch.expired = False
                            watch.task.uncancel()
                if ctx._tx is not None:
                    error = await self._settle_transaction(ctx, env_id, error)
                    if isinstance(error, AlreadyHandled):
                        stats.duplicates += 1
                        await delivery.ack()
                        if tracked:
                            await self._forget(env_id)
                        return
                if error is None:
                    break
                if attempt >= policy.max_attempts:
                    await self._dead_letter(delivery, env_id, error, attempts=attempt)
                    if tracked:
                        await self._forget(env_id)
                    return
                stats.retries += 1
                # Recorded before the next attempt: a redelivery after a crash goes on from
                # here instead of starting over.
                await self.attempts.failed(group, env_id, f"{type(error).__name__}: {error}")
                self._note_recorded(env_id)
                tracked = True
                env = ctx._envelope  # if this attempt built it, the next one gets the same
                _log.info(
                    "%s: attempt %d of %s failed (%s: %s); retrying",
                    self.name,
                    attempt,
                    env_id,
                    type(error).__name__,
                    error,
                )
                await asyncio.sleep(policy.delay(attempt))
            if ctx._outbox:
                try:
                    await app._send_all(ctx._take_outbox())
                except MessageRefusedError as exc:
                    # Sending it again changes nothing: dead-letter the handled message
                    # (not marked handled, so a replay runs the handler again).
                    await self._dead_letter(delivery, env_id, exc, attempts=attempt)
                    if tracked:
                        await self._forget(env_id)
                    return
            if idempotent and not ctx._committed:
                mark_nowait = self._mark_nowait
                if mark_nowait is not None:
                    mark_nowait(group, env_id)
                else:
                    await self.dedup.mark(group, env_id)
            stats.handled += 1
            if self._failures:
                self._failures = 0
                self._log.clear("infrastructure")
            await delivery.ack()
            if tracked:
                await self._forget(env_id)
        except Exception:
            # A failure around the handler: the caller gives the message back. If its record
            # was read, the next delivery is this consumer's own give-back, not a crash's.
            if tracked:
                self._bounded_put(self._gave_back, env_id)
            raise
        finally:
            self._active -= 1
            if guarded:
                busy = self._handling.pop(env_id)
                if busy is not None and not busy.done():
                    busy.set_result(None)

    def _note_recorded(self, env_id: str) -> None:
        self._bounded_put(self._recorded, env_id)

    @staticmethod
    def _bounded_put(ids: dict[str, None], env_id: str) -> None:
        """Remember ``env_id`` in ``ids``, forgetting the oldest past ``_RECORDED_MAX``."""
        ids[env_id] = None
        if len(ids) > _RECORDED_MAX:
            del ids[next(iter(ids))]

    async def _forget(self, env_id: str) -> None:
        """Drop the message's attempt record: it was handled or dead-lettered (best effort:
        a record left behind only ages out)."""
        self._recorded.pop(env_id, None)
        try:
            await self.attempts.clear(self.group, env_id)
        except Exception as exc:
            self._log.warning(
                "forget", "%s: could not clear the attempts of %s: %s", self.name, env_id, exc
            )

    async def _roll_back(self, ctx: Context, cause: BaseException) -> None:
        """Roll back the handling's transaction after ``cause`` (a cancellation or a failed
        write); a rollback that fails is logged, and the transaction is gone either way
        (the server rolls back what a dropped connection had open)."""
        try:
            await ctx._finish_transaction(cause)
        except Exception as exc:
            _log.warning(
                "%s: rolling back the handler's transaction failed (%s: %s); the store drops "
                "it with its connection",
                self.name,
                type(exc).__name__,
                exc,
            )

    async def _settle_transaction(
        self, ctx: Context, env_id: str, error: BaseException | None
    ) -> BaseException | None:
        """Finish the handler's store transaction: on success write the dedup entry and the
        queued messages into it and commit; on failure roll back. Returns the handler's error
        (or ``AlreadyHandled``: a copy committed first). A failure of eventflow's own writes
        or of the commit raises: it is a failure around the handler, not an attempt."""
        if error is None and ctx._tx_failed is not None:
            failed = ctx._tx_failed
            error = RuntimeError(
                "the `async with ctx.transaction()` block raised "
                f"{type(failed).__name__}: {failed}; its transaction was rolled back"
            )
        if error is not None:
            await self._roll_back(ctx, error)
            return error
        store = self.app.store
        try:
            tx = ctx._tx
            assert tx is not None
            if self.spec.idempotent:
                await store.mark_handled(self.group, env_id, tx)
            outbox = ctx._take_outbox()
            if outbox:
                await store.outbox.add(outbox, tx=tx)
        except BaseException as exc:
            await self._roll_back(ctx, exc)
            if isinstance(exc, AlreadyHandled):
                return exc  # a copy handled concurrently elsewhere committed first
            raise
        await ctx._finish_transaction(None)
        ctx._committed = True
        if self.spec.idempotent and self.dedup is not store.dedup:
            # A separate dedup store (Redis) cannot join the SQL transaction: mark it too,
            # right after the commit, so copies are skipped there as well.
            await self.dedup.mark(self.group, env_id)
        return None

    def _decode(self, fields: dict[str, Any]) -> tuple[Envelope, Any]:
        """Build the envelope from its checked wire fields and decode the handler's argument:
        the envelope itself, or its event upcast and validated."""
        env = Envelope._trusted(fields)
        sig = self.signature
        accepts = sig.accepts
        if accepts is None:
            return env, env
        cls = accepts.get(env.type)
        if cls is not None:
            return env, self.registry.decode_as(env, cls)
        if sig.any_event:
            return env, self.registry.decode(env)
        known = env.type in self.registry.types()
        raise UnknownEventTypeError(
            f"handler {self.spec.name} does not accept {env.type!r}"
            + (
                f" (it takes {', '.join(sorted(accepts))}); add it to the handler's union "
                "or narrow the pattern"
                if known
                else f": no Event class defines {env.type!r}; define it or narrow the pattern"
            )
        )

    async def _dead_letter(
        self,
        delivery: Delivery,
        envelope_id: str | None,
        error: BaseException,
        *,
        attempts: int,
    ) -> None:
        reason = getattr(error, "reason", "handler-failed")
        text = f"{type(error).__name__}: {error}"
        if not isinstance(error, DecodeError) and error.__traceback__ is not None:
            tb = "".join(traceback.format_exception(error, limit=5))
            text = f"{text}\n{tb}"
        if not self.spec.dead_letter:
            self.stats.dropped += 1
            _log.error(
                "%s: dropping message %s after %d attempts (dead_letter=False): %s",
                self.name,
                envelope_id or "?",
                attempts,
                text,
            )
            await delivery.ack()
            return
        letter = DeadLetter(
            id=new_id(),
            topic=delivery.topic,
            group=self.group,
            payload=bytes(delivery.payload),
            error=text,
            attempts=attempts,
            failed_at=datetime.now(UTC),
            reason=reason,
            key=delivery.key,
            headers={k: v for k, v in delivery.headers.items() if k != TARGET_GROUP_HEADER},
            envelope_id=envelope_id,
            source=dict(delivery.metadata),
        )
        await self.dead_letters.add(letter)
        self.stats.dead_lettered += 1
        _log.warning(
            "%s: dead-lettered %s (%s) after %d attempts: %s",
            self.name,
            envelope_id or "undecodable message",
            reason,
            attempts,
            f"{type(error).__name__}: {error}",
        )
        await delivery.ack()
