"""The consumer of one subscription: a keyed dispatcher running the message pipeline.

- ``dispatch.Dispatcher`` fetches within a window (``max_inflight``), files deliveries into
  lanes and runs ``concurrency`` workers over them: one key in order, different keys in
  parallel; at shutdown it gives back what no handler started.
- ``pipeline.Pipeline`` handles one delivery: decode, dedup, attempts, the handler with
  retries, the commit, the ack or the dead letter.
- ``watchdog.Watchdog`` cancels handler calls that run past ``timeout``; the app's
  ``stall.StallGuard`` (a thread) ends the process past ``hard_timeout``.
- ``settlement.Settlement`` commits or rolls back a handler's ``ctx.transaction()``.
- ``outcomes.decide`` says what follows a failed attempt (retry, ``RetryLater``, the
  dead-letter queue) and ``letters.Letters`` files the dead letters.

A run ends when the consumer is asked to stop or its subscription fails (``fetch``
raises): it stops fetching, lets running handlers finish within the grace period (then
cancels them), gives back what it fetched and no handler started, and closes the
subscription so everything unacked is redelivered. After a failure the app's supervisor
starts a new run on a new subscription.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..limits.errors import GivenBack
from ..limits.pause import Pause
from ..ports import Broker, DedupStore, Delivery, Lag, Subscription, declared
from ..subscribe import HandlerSpec, Signature
from .dispatch import Dispatcher
from .host import ConsumerHost
from .pipeline import ConsumerStats, CrashLoopError, Pipeline
from .stall import StallGuard
from .watchdog import Watchdog

if TYPE_CHECKING:
    from ..telemetry.tracing import Tracing

__all__ = ["Consumer", "ConsumerStats", "CrashLoopError"]


class Consumer:
    """Runs one ``@subscribe`` handler for one group over one broker subscription."""

    def __init__(
        self,
        host: ConsumerHost,
        spec: HandlerSpec,
        group: str,
        signature: Signature,
        *,
        grace_period: float,
        max_inflight: int | None = None,
        guard: StallGuard | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.host = host
        self.spec = spec
        self.group = group
        self.signature = signature
        self.grace_period = grace_period
        self.max_inflight = max_inflight or max(64, spec.concurrency * 16)
        self._guard = guard  # times the handler's hard_timeout, if it has one
        self._pipeline = Pipeline(host, spec, group, signature, self.name, tracing=tracing)
        self._pause = Pause(host.limits, self.name, self._pipeline.stats)
        self._sub: Subscription | None = None
        self._dispatcher: Dispatcher | None = None  # the current run's
        self._stop_requested = False

    @property
    def name(self) -> str:
        """``group:pattern`` — how status and logs name this consumer."""
        return f"{self.group}:{self.spec.pattern}"

    async def lag(self) -> Lag:
        """What this consumer's group has not handled yet on its pattern, across every
        member, and when the oldest of it was published (``Broker.lag``); raises
        ``BrokerError`` when the broker cannot be asked."""
        lag = declared(self.host.broker, Broker, "lag")
        value: Lag = await lag(self.spec.pattern, group=self.group)
        return value

    @property
    def inflight(self) -> int:
        """Deliveries of the current run fetched and not yet settled (handled, dead-lettered
        or given back); 0 between runs."""
        dispatcher = self._dispatcher
        return 0 if dispatcher is None else dispatcher.inflight

    @property
    def stats(self) -> ConsumerStats:
        """Counters since the consumer started."""
        return self._pipeline.stats

    def observe(
        self,
        attempt: Callable[[float], None] | None,
        handled: Callable[[float], None] | None,
    ) -> None:
        """Call ``attempt(seconds)`` after each handler attempt and ``handled(seconds)``
        with each handled message's age since its publish (``eventflow.metrics``); None
        stops observing."""
        self._pipeline.observe_attempt = attempt
        self._pipeline.observe_handled = handled

    @property
    def dedup(self) -> DedupStore:
        """The dedup store of this consumer's idempotent handling (the app's)."""
        return self._pipeline.dedup

    @dedup.setter
    def dedup(self, store: DedupStore) -> None:
        self._pipeline.dedup = store

    async def subscribe(self) -> None:
        """Join the group (created at the spec's ``start`` if it does not exist yet); after
        this returns, new messages reach this consumer."""
        self._sub = await self.host.broker.subscribe(
            self.spec.pattern, group=self.group, start=self.spec.start
        )

    def stop(self) -> None:
        """Ask the consumer to stop fetching and drain; ``run`` then returns."""
        self._stop_requested = True
        if self._dispatcher is not None:
            self._dispatcher.stop()

    def _watchdog(self) -> Watchdog | None:
        spec = self.spec
        if spec.timeout is None:
            return None
        return Watchdog(
            spec.timeout, hard_timeout=spec.hard_timeout, guard=self._guard, name=spec.name
        )

    async def _give_back(self, deliveries: Sequence[Delivery], exc: Exception) -> None:
        """A limit refused the message (``GivenBack``): released, no attempt spent, the
        gate held while its breaker is open; anything else is a failure around the handler."""
        if isinstance(exc, GivenBack):
            await self._pause.given_back(deliveries, exc)
        else:
            await self._pipeline.give_back(deliveries, exc)

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
        spec, pipeline = self.spec, self._pipeline
        dispatcher = self._dispatcher = Dispatcher(
            sub,
            pipeline.process,
            self._give_back,
            concurrency=spec.concurrency,
            max_inflight=self.max_inflight,
            grace_period=self.grace_period,
            name=self.name,
            watchdog=self._watchdog(),
            gate=self._pause,
            prepare=pipeline.fetched if pipeline.looks_up_batches else None,
        )
        if self._stop_requested:  # asked while subscribing
            dispatcher.stop()
        try:
            await dispatcher.run()
        finally:
            self._sub = None
            self._dispatcher = None
            await sub.close()
