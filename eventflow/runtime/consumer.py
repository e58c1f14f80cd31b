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
import logging
import traceback
from collections import deque
from collections.abc import Hashable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ..context import Context
from ..envelope import Envelope, new_id
from ..errors import DecodeError, HandlerTimeoutError, UnknownEventTypeError
from ..events import EventRegistry
from ..ports import DeadLetter, DeadLetterStore, DedupStore, Delivery, Subscription
from ..subscribe import HandlerSpec, Signature

if TYPE_CHECKING:
    from ..app import App

__all__ = ["TARGET_GROUP_HEADER", "Consumer", "ConsumerStats"]

TARGET_GROUP_HEADER = "eventflow-target-group"
"""Broker header naming the only group that should handle a message (dead-letter replay)."""

_log = logging.getLogger("eventflow.consumer")


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
        self._lanes: dict[Hashable, deque[Delivery]] = {}
        self._ready: asyncio.Queue[Hashable] = asyncio.Queue(maxsize=self.max_inflight)
        self._inflight = 0
        self._slot = asyncio.Event()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._stopped = asyncio.Event()

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
                workers = [tg.create_task(self._worker()) for _ in range(self.spec.concurrency)]
                fetcher = tg.create_task(self._fetch_loop(sub))
                await self._stopped.wait()
                fetcher.cancel()
                try:
                    async with asyncio.timeout(self.grace_period):
                        await self._idle.wait()
                except TimeoutError:
                    _log.warning(
                        "%s: handlers still running after the %.1fs grace period; cancelling "
                        "them (their messages will be redelivered)",
                        self.name,
                        self.grace_period,
                    )
                for worker in workers:
                    worker.cancel()
        finally:
            await sub.close()

    async def _fetch_loop(self, sub: Subscription) -> None:
        lanes, ready, slot = self._lanes, self._ready, self._slot
        limit = self.max_inflight
        while True:
            free = limit - self._inflight
            if free <= 0:
                slot.clear()
                await slot.wait()
                continue
            batch = await sub.fetch(free, 1.0)
            self._inflight += len(batch)
            for delivery in batch:
                key: Hashable = delivery.key if delivery.key is not None else delivery
                lane = lanes.get(key)
                if lane is None:
                    lanes[key] = deque((delivery,))
                    ready.put_nowait(key)
                else:
                    lane.append(delivery)

    async def _worker(self) -> None:
        lanes, ready = self._lanes, self._ready
        while True:
            key = await ready.get()
            lane = lanes[key]
            while lane and not self._stopping:
                self._active += 1
                self._idle.clear()
                try:
                    await self._process(lane[0])
                finally:
                    self._active -= 1
                    if self._active == 0:
                        self._idle.set()
                lane.popleft()
                self._inflight -= 1
                self._slot.set()
            if not self._stopping:
                del lanes[key]

    # -- one delivery ------------------------------------------------------------------------

    async def _process(self, delivery: Delivery) -> None:
        stats = self.stats
        stats.received += 1
        headers = delivery.headers
        if headers:
            target = headers.get(TARGET_GROUP_HEADER)
            if target is not None and target != self.group:
                await delivery.ack()  # a replay meant for another group
                return
        try:
            env = Envelope.from_bytes(delivery.payload)
        except DecodeError as exc:
            await self._dead_letter(delivery, None, exc, attempts=0)
            return
        idempotent = self.spec.idempotent
        if idempotent and await self.dedup.seen(self.group, env.id):
            stats.duplicates += 1
            await delivery.ack()
            return
        try:
            arg = self._decode(env)
        except DecodeError as exc:
            await self._dead_letter(delivery, env, exc, attempts=0)
            return
        policy = self.spec.retry
        attempt = delivery.delivery_count - 1  # earlier deliveries each ended in an attempt
        if attempt >= policy.max_attempts:
            await self._dead_letter(
                delivery,
                env,
                RuntimeError(
                    f"delivered {delivery.delivery_count} times without being acked "
                    f"(max_attempts={policy.max_attempts})"
                ),
                attempts=attempt,
            )
            return
        fn = self.spec.fn
        timeout = self.spec.timeout
        takes_ctx = self.signature.takes_context
        while True:
            attempt += 1
            ctx = Context(self.app, env, self.group, attempt)
            try:
                if timeout is None:
                    await (fn(arg, ctx) if takes_ctx else fn(arg))
                else:
                    async with asyncio.timeout(timeout) as scope:
                        await (fn(arg, ctx) if takes_ctx else fn(arg))
            except Exception as exc:
                error: BaseException = exc
                if timeout is not None and isinstance(exc, TimeoutError) and scope.expired():
                    error = HandlerTimeoutError(
                        f"handler {self.spec.name} ran past its {timeout}s timeout"
                    )
                if attempt >= policy.max_attempts:
                    await self._dead_letter(delivery, env, error, attempts=attempt)
                    return
                stats.retries += 1
                _log.info(
                    "%s: attempt %d of %s failed (%s: %s); retrying",
                    self.name,
                    attempt,
                    env.id,
                    type(error).__name__,
                    error,
                )
                await asyncio.sleep(policy.delay(attempt))
                continue
            outbox = ctx._take_outbox()
            if outbox:
                await self.app._send_all(outbox)
            if idempotent:
                await self.dedup.mark(self.group, env.id)
            stats.handled += 1
            await delivery.ack()
            return

    def _decode(self, env: Envelope) -> Any:
        sig = self.signature
        accepts = sig.accepts
        if accepts is None:
            return env
        cls = accepts.get(env.type)
        if cls is not None:
            return self.registry.decode_as(env, cls)
        if sig.any_event:
            return self.registry.decode(env)
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
        self, delivery: Delivery, env: Envelope | None, error: BaseException, *, attempts: int
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
                env.id if env else "?",
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
            envelope_id=env.id if env else None,
            source=dict(delivery.metadata),
        )
        await self.dead_letters.add(letter)
        self.stats.dead_lettered += 1
        _log.warning(
            "%s: dead-lettered %s (%s) after %d attempts: %s",
            self.name,
            env.id if env else "undecodable message",
            reason,
            attempts,
            f"{type(error).__name__}: {error}",
        )
        await delivery.ack()
