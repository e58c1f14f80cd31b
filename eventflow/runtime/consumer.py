"""The consumer loop of one subscription.

One fetch task pulls deliveries while fewer than ``max_inflight`` are unsettled and files
them into per-key lanes; ``concurrency`` worker tasks each take a ready lane and handle its
messages in order, so one key is handled in publish order while different keys run in
parallel. Keyless messages each get a lane of their own.

Handling one delivery: decode the envelope -> skip if the dedup store has its id -> decode
the typed event (upcast, validate) -> call the handler with a soft timeout, retrying with
backoff -> send what the handler published -> mark the id handled -> ack. Bad input and
exhausted retries go to the dead-letter store before the ack, so nothing is lost.

Shutdown: stop fetching, let running handlers finish within the grace period (then cancel
them), and close the subscription so everything unacked is redelivered.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from ..context import Context
from ..envelope import Envelope, _wire_fields, new_id
from ..errors import AlreadyHandled, DecodeError, HandlerTimeoutError, UnknownEventTypeError
from ..events import EventRegistry
from ..ports import DeadLetter, DeadLetterStore, DedupStore, Delivery, Subscription
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

    __slots__ = ("calls", "expired", "seen", "seen_at", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.calls = 0
        self.expired = False  # the watchdog cancelled the current call
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
        self.grace_period = grace_period
        self.max_inflight = max_inflight or max(64, spec.concurrency * 16)
        self.stats = ConsumerStats()
        self._sub: Subscription | None = None
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
        self._failures = 0  # infrastructure failures in a row (reset by a handled message)
        # The serial loop's fetched batch; from index _batch_from on, not yet started.
        self._batch: Sequence[Delivery] = ()
        self._batch_from = 0
        # envelope id -> the handling in progress (concurrency > 1 only), so a duplicate
        # fetched while the original runs waits for its outcome: None until a duplicate
        # arrives and makes the future it waits on (one future per duplicate, not per message).
        self._handling: dict[str, asyncio.Future[None] | None] = {}
        self._guard_ids = spec.idempotent and spec.concurrency > 1
        self._stopping = False
        self._stopped = asyncio.Event()
        self._watches: list[_Watch] = []  # one per worker task
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

    @property
    def name(self) -> str:
        """``group:pattern`` — how status and logs name this consumer."""
        return f"{self.group}:{self.spec.pattern}"

    async def subscribe(self) -> None:
        """Join the group; after this returns, new messages reach this consumer."""
        self._sub = await self.app.broker.subscribe(self.spec.pattern, group=self.group)

    def stop(self) -> None:
        """Ask the consumer to stop fetching and drain; ``run`` then returns."""
        self._stopping = True
        self._stopped.set()

    async def run(self) -> None:
        """Fetch and handle until ``stop``; then drain within the grace period."""
        sub = self._sub
        if sub is None:
            raise RuntimeError("Consumer.subscribe() must be awaited before run()")
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
            await self._release_unstarted()
            await sub.close()

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
            batch = self._batch = await sub.fetch(limit, 1.0)
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
            batch = await sub.fetch(limit - self._inflight, 1.0)
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
        """Survive a failure outside the handler (dedup store, dead-letter store, broker
        ack): the message was not acked, so give it back for redelivery after a pause, give
        back the ones fetched behind it, and keep consuming."""
        self._failures += 1
        delay = min(_FAILURE_BACKOFF_MAX, _FAILURE_BACKOFF * 2 ** min(self._failures, 8))
        _log.error(
            "%s: infrastructure error while processing a message (%s: %s); it will be "
            "redelivered in %.1fs",
            self.name,
            type(exc).__name__,
            exc,
            delay,
        )
        for delivery, action in [(failed, "nack"), *((d, "release") for d in rest)]:
            try:
                if action == "nack":
                    await delivery.nack(delay)
                else:
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
                    watch.task.cancel()

    # -- one delivery ------------------------------------------------------------------------

    async def _process(self, delivery: Delivery, watch: _Watch) -> None:
        # `_active` counts running handlers so shutdown can wait for them to finish.
        self._active += 1
        guarded = False
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
            attempt = delivery.delivery_count - 1  # earlier deliveries each ended in an attempt
            if attempt >= policy.max_attempts:
                await self._dead_letter(
                    delivery,
                    env_id,
                    RuntimeError(
                        f"delivered {delivery.delivery_count} times without being acked "
                        f"(max_attempts={policy.max_attempts})"
                    ),
                    attempts=attempt,
                )
                return
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
                    timed_out = watch.expired and watch.task.cancelling() <= 1
                    if not timed_out:
                        if ctx._tx is not None:
                            with contextlib.suppress(BaseException):
                                await ctx._finish_transaction(exc)  # same context: rollback
                        raise  # shutdown, not our timeout
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
                        return
                if error is None:
                    break
                if attempt >= policy.max_attempts:
                    await self._dead_letter(delivery, env_id, error, attempts=attempt)
                    return
                stats.retries += 1
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
                await app._send_all(ctx._take_outbox())
            if idempotent and not ctx._committed:
                mark_nowait = self._mark_nowait
                if mark_nowait is not None:
                    mark_nowait(group, env_id)
                else:
                    await self.dedup.mark(group, env_id)
            stats.handled += 1
            self._failures = 0
            await delivery.ack()
        finally:
            self._active -= 1
            if guarded:
                busy = self._handling.pop(env_id)
                if busy is not None and not busy.done():
                    busy.set_result(None)

    async def _settle_transaction(
        self, ctx: Context, env_id: str, error: BaseException | None
    ) -> BaseException | None:
        """Finish the handler's store transaction: on success write the dedup entry and the
        queued messages into it and commit; on failure roll back. Returns the error, if any
        (a failed commit becomes the attempt's error)."""
        if error is None and ctx._tx_failed is not None:
            failed = ctx._tx_failed
            error = RuntimeError(
                "the `async with ctx.transaction()` block raised "
                f"{type(failed).__name__}: {failed}; its transaction was rolled back"
            )
        if error is not None:
            await ctx._finish_transaction(error)
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
            with contextlib.suppress(Exception):
                await ctx._finish_transaction(exc)
            if isinstance(exc, AlreadyHandled):
                return exc  # a copy handled concurrently elsewhere committed first
            if not isinstance(exc, Exception):
                raise  # cancelled: rolled back, the message is redelivered
            return exc
        try:
            await ctx._finish_transaction(None)
        except Exception as exc:
            return exc
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
