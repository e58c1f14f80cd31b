"""The message pipeline: one delivery from its bytes to its ack.

Handling one delivery: skip a replay meant for another group -> decode the envelope ->
skip if the dedup store has its id (``HandlerSpec.dedup_at_commit``: found at the commit)
-> decode the typed event (upcast, validate) -> a compensation whose command the group has
not handled cancels it instead (``compensation``) -> call the handler with a soft timeout,
retrying with backoff -> settle its transaction, if it opened one -> send what it published
-> mark the id handled -> ack (a stream found moved at the commit: applied again at once,
no attempt spent). Bad input and exhausted retries go to the dead-letter store
before the ack, so nothing is lost. What a failed attempt leads to is ``outcomes.decide``'s:
a rejection (``Reject``, ``give_up_on``) is dead-lettered at once, a ``RetryLater`` is given
back to the broker with its delay (the worker goes on), anything else is retried in place
after the policy's backoff.

Attempts count handler failures only. A failure is recorded in the store's ``attempts``
before the next attempt, so a redelivery (after a crash) goes on from the right attempt;
a message handled at its first delivery writes nothing there. A redelivery whose handler
starts is recorded too: a message whose handlers keep being started and never finish (the
process dies on it) is dead-lettered after ``max_deliveries`` as a crash loop, while
messages a dying process had fetched but not started are charged nothing. A failure
around the handler (the dedup store, the commit, the broker's ack) is no attempt either:
``process`` raises, the message is given back untouched (``release``, see ``give_back``)
and its worker pauses, with a backoff of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._logging import Throttled
from ..context import Context
from ..envelope import _wire_fields
from ..errors import (
    AlreadyHandled,
    DecodeError,
    HandlerTimeoutError,
    MessageRefusedError,
)
from ..headers import TARGET_GROUP_HEADER
from ..limits.errors import GivenBack
from ..ports import Delivery
from ..subscribe import HandlerSpec, Signature
from .compensation import Compensations, compensated_command
from .decoding import decode_argument
from .host import ConsumerHost
from .letters import Letters
from .lookups import Lookups
from .outcomes import Verdict, decide
from .settlement import MovedAtCommit, Settlement
from .stats import ConsumerStats
from .watchdog import Watch

if TYPE_CHECKING:
    from ..telemetry.tracing import Tracing

__all__ = ["ConsumerStats", "CrashLoopError", "Pipeline"]

_log = logging.getLogger("eventflow.consumer")
_FAILURE_BACKOFF = 0.05
_FAILURE_BACKOFF_MAX = 5.0
_RECORDED_MAX = 10_000  # ids with an attempt record this process knows of (bounded)
_MOVED_MAX = 50  # a message applied again at once when its commit found a stream moved


class CrashLoopError(Exception):
    """A message whose handlers were started again and again without ever finishing."""

    reason = "crash-loop"


class Pipeline:
    """Handles the deliveries of one ``@subscribe`` handler in one group."""

    def __init__(
        self,
        host: ConsumerHost,
        spec: HandlerSpec,
        group: str,
        signature: Signature,
        name: str,
        *,
        tracing: Tracing | None = None,
    ) -> None:
        self.host = host
        self.spec = spec
        self.group = group
        self.signature = signature
        self.name = name
        self.dedup = host.dedup
        self.stats = ConsumerStats()
        self._log = Throttled(_log)
        self._tracing = tracing
        self._events = None if tracing is None else tracing.events(host.store)
        # With tracing on, each delivery is handled inside its `process` span.
        self._entry = self._handle if tracing is None else self._traced
        self._settlement = Settlement(
            host.store, group, idempotent=spec.idempotent, name=name, tracing=tracing
        )
        self._letters = Letters(
            host.store, group, name, self.stats, keep=spec.dead_letter, tracing=tracing
        )
        self._compensations = Compensations(
            host.store, group, idempotent=spec.idempotent, name=name
        )
        # Ids whose attempt record this process wrote (bounded, oldest forgotten first): a
        # delivery of one of them reads its record even when the broker counts it as a
        # first delivery (it was given back untouched after its failures were recorded).
        self._recorded: dict[str, None] = {}
        # Ids this consumer gave back after reading their record (bounded likewise): their
        # next delivery is not a crash's, so it counts no start.
        self._gave_back: dict[str, None] = {}
        # Ids given back to the broker with a delay (RetryLater) -> how often (bounded): a
        # broker's delivery count includes those redeliveries, which are no crash's.
        self._deferred: dict[str, int] = {}
        self._failures = 0  # failures around the handler in a row (reset by a handled message)
        # envelope id -> the handling in progress, so a duplicate fetched while the original
        # runs waits for its outcome: None until a duplicate arrives and makes the future it
        # waits on. Only with several workers: one worker never runs two handlings at once.
        self._handling: dict[str, asyncio.Future[None] | None] = {}
        self._guard_ids = spec.idempotent and spec.concurrency > 1
        # No dedup check before the handler where its transaction finds a copy (a rollback
        # at its dedup entry, settlement.py), but for redeliveries, likely copies.
        in_tx = spec.dedup_at_commit and self.dedup is host.store.dedup
        self._check_first = spec.idempotent and not in_tx
        self._lookups = Lookups(group, name)  # verdicts of whole fetched batches
        # Metrics (eventflow.metrics) observe each attempt's seconds and each handled
        # message's seconds since its publish; None (the default) costs nothing.
        self.observe_attempt: Callable[[float], None] | None = None
        self.observe_handled: Callable[[float], None] | None = None

    async def process(self, delivery: Delivery, watch: Watch) -> bool:
        """Handle one delivery to its outcome (handled, duplicate, dead-lettered or dropped)
        and ack it, or give it back to the broker for a later attempt (``RetryLater``):
        returns True then, and the caller gives back what it holds of the same key, which
        must not overtake it. Raises on a failure around the handler: the caller gives it
        back."""
        self.stats.received += 1
        headers = delivery.headers
        if headers:
            target = headers.get(TARGET_GROUP_HEADER)
            if target is not None and target != self.group:
                await delivery.ack()  # a replay meant for another group
                return False
        # The checked wire fields: a duplicate is dropped before the Envelope is built.
        try:
            fields = _wire_fields(delivery.payload)
        except DecodeError as exc:
            await self._letters.file(delivery, None, exc, attempts=0)
            return False
        env_id: str = fields["id"]
        if not self._guard_ids:
            return await self._entry(delivery, fields, env_id, watch)
        # Two copies of one message in flight at once (a republish without a key): the
        # second waits for the first's outcome, then finds it in the dedup store.
        handling = self._handling
        while env_id in handling:
            busy = handling[env_id]
            if busy is None:
                busy = handling[env_id] = asyncio.get_running_loop().create_future()
            await asyncio.shield(busy)
        handling[env_id] = None
        try:
            return await self._entry(delivery, fields, env_id, watch)
        finally:
            busy = handling.pop(env_id)
            if busy is not None and not busy.done():
                busy.set_result(None)

    @property
    def looks_up_batches(self) -> bool:
        """Whether fetched batches should go through ``fetched`` (it checks before handling)."""
        return self._check_first

    async def fetched(self, deliveries: Sequence[Delivery]) -> None:
        """A batch was fetched: look its ids up in the dedup store at once (``lookups``)."""
        await self._lookups.fetched(self.dedup, deliveries)

    async def _traced(
        self, delivery: Delivery, fields: dict[str, Any], env_id: str, watch: Watch
    ) -> bool:
        """``_handle`` in the delivery's ``process`` span (tracing on)."""
        assert self._tracing is not None
        with self._tracing.processing(delivery.topic, fields, self.group, delivery.metadata):
            return await self._handle(delivery, fields, env_id, watch)

    async def _handle(
        self, delivery: Delivery, fields: dict[str, Any], env_id: str, watch: Watch
    ) -> bool:
        spec, group, stats = self.spec, self.group, self.stats
        # True once the message has (or may have) an attempt record to forget at the end.
        tracked = delivery.delivery_count > 1 or env_id in self._recorded
        seen = self._lookups.take(env_id) if self._check_first or tracked else False
        if seen is None and spec.idempotent:
            seen = await self.dedup.seen(group, env_id)
        if seen:  # handled (then, if it has a record, stopped before it forgot the record)
            await self._compensations.skipped(self.dedup, env_id, stats)
            await self._ack(delivery, env_id, tracked)
            return False
        try:
            env, arg = decode_argument(self.signature, self.host.registry, spec.name, fields)
            command = compensated_command(fields, env_id)
        except Exception as exc:  # DecodeError, or a validator raising something else
            await self._letters.file(delivery, env_id, exc, attempts=0)
            return False
        if command is not None and await self._compensations.arrived(
            self.dedup, env_id, command, stats
        ):
            self._lookups.forget(env_id)
            await self._ack(delivery, env_id, tracked)  # cancelled its command: nothing to undo
            return False
        try:
            attempt = 0  # handler attempts that failed before this one
            if tracked:
                failures = await self._failures_on_record(delivery, env_id)
                if failures is None:
                    return False  # dead-lettered as a crash loop
                attempt = failures
            policy, moved = spec.retry, 0
            while True:
                attempt += 1
                ctx = Context(self.host, env, group, attempt, fields=fields)
                if self._events is not None:
                    ctx._events = self._events  # ctx.store appends are spans
                error = await self._call(ctx, arg, watch)
                if ctx._tx is not None:
                    error = await self._settlement.settle(ctx, env_id, error)
                    if isinstance(error, AlreadyHandled):
                        # Rolled back: a copy committed first, or a compensation cancelled it.
                        await self._compensations.skipped(
                            self.host.store.dedup, env_id, stats, rolled_back=True
                        )
                        await self._ack(delivery, env_id, tracked)
                        return False
                    if isinstance(error, MovedAtCommit) and moved < _MOVED_MAX:
                        moved, attempt = moved + 1, attempt - 1  # no attempt spent
                        stats.applied_again += 1
                        continue
                if isinstance(error, GivenBack):
                    raise error  # a limit refused it: given back, no attempt (limits.pause)
                if error is None:
                    await self._succeeded(delivery, ctx, env_id, attempt, tracked)
                    return False
                stats.failed += 1
                decision = decide(error, attempt, spec)
                if decision.verdict is Verdict.DEAD:
                    await self._letters.file(
                        delivery, env_id, error, attempts=attempt, reason=decision.reason
                    )
                    if tracked:  # after the letter is stored: its record kept counting till then
                        await self._forget(env_id)
                    return False
                stats.retries += 1
                if self._tracing is not None:
                    self._tracing.attempt_failed(error, attempt, decision.verdict is Verdict.LATER)
                # Recorded before the next attempt: a redelivery after a crash goes on from
                # here instead of starting over.
                await self._record_failure(env_id, error)
                tracked = True
                if decision.verdict is Verdict.LATER:
                    await self._retry_later(delivery, env_id, attempt, decision.delay)
                    return True  # its record stays: the redelivery goes on from it
                _log.info(
                    "%s: attempt %d of %s failed (%s: %s); retrying",
                    self.name,
                    attempt,
                    env_id,
                    type(error).__name__,
                    error,
                )
                await asyncio.sleep(policy.delay(attempt))
        except Exception:
            # A failure around the handler: the caller gives the message back. If its record
            # was read, the next delivery is this consumer's own give-back, not a crash's.
            if tracked:
                self._bounded_put(self._gave_back, env_id)
            raise

    async def _retry_later(
        self, delivery: Delivery, env_id: str, attempt: int, delay: float
    ) -> None:
        """``RetryLater``: give the message back to the broker, which redelivers it after
        ``delay`` (its key's later messages wait; other keys go on). Its redelivery is this
        consumer's own give-back, not a crash's: it counts no start towards
        ``max_deliveries`` (when it reaches this process again; another member that gets it
        counts one, so keep ``max_deliveries`` above ``retry``)."""
        _log.info(
            "%s: attempt %d of %s asked to be retried no sooner than %.3gs from now",
            self.name,
            attempt,
            env_id,
            delay,
        )
        self._bounded_put(self._gave_back, env_id)
        later = self._deferred
        later[env_id] = later.pop(env_id, 0) + 1
        if len(later) > _RECORDED_MAX:
            del later[next(iter(later))]
        await delivery.nack(delay)

    async def _failures_on_record(self, delivery: Delivery, env_id: str) -> int | None:
        """Not the first delivery (or given back after a recorded failure): the record tells
        which attempt this is, and how often handlers were started without ever finishing.
        Returns the failed attempts, or None after dead-lettering the message as a crash
        loop. A start is counted for a delivery after one that ended without an outcome (a
        crash), not after this consumer gave it back itself."""
        attempts, spec = self.host.store.attempts, self.spec
        given_back_here = env_id in self._gave_back
        if given_back_here:
            del self._gave_back[env_id]
        if delivery.delivery_count > 1 and not given_back_here:
            self.stats.redelivered += 1
            record = await attempts.started(self.group, env_id)
        else:
            record = await attempts.get(self.group, env_id)
        self._bounded_put(self._recorded, env_id)
        unfinished = (
            1 + record.starts
            if attempts.durable
            else delivery.delivery_count - 1 - self._deferred.get(env_id, 0)
        )
        if unfinished < spec.max_deliveries:
            return record.failures
        await self._letters.file(
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
        return None

    async def _call(self, ctx: Context, arg: Any, watch: Watch) -> BaseException | None:
        """One attempt: call the handler under the watchdog; return its error (None: it
        returned). A cancellation that is not the watchdog's (shutdown) rolls back the
        handling's transaction and propagates: no attempt spent."""
        spec = self.spec
        observe = self.observe_attempt
        began = time.perf_counter() if observe is not None else 0.0
        watch.enter()
        try:
            await (spec.fn(arg, ctx) if self.signature.takes_context else spec.fn(arg))
        except asyncio.CancelledError as exc:
            if not watch.timed_out():
                if ctx._tx is not None:
                    await self._settlement.roll_back(ctx, exc)
                raise
            return HandlerTimeoutError(f"handler {spec.name} ran past its {spec.timeout}s timeout")
        except Exception as exc:
            return exc
        finally:
            watch.leave()
            if observe is not None:
                observe(time.perf_counter() - began)
        return None

    async def _succeeded(
        self, delivery: Delivery, ctx: Context, env_id: str, attempt: int, tracked: bool
    ) -> None:
        """The handler succeeded: send what it published, mark the id handled, ack (after
        forgetting its attempt record, if ``tracked``: it may have one)."""
        if ctx._outbox:
            try:
                await self.host.send_outgoing(ctx._take_outbox())
            except MessageRefusedError as exc:
                # Sending it again changes nothing: dead-letter the handled message (not
                # marked handled, so a replay runs the handler again).
                await self._letters.file(delivery, env_id, exc, attempts=attempt)
                if tracked:
                    await self._forget(env_id)
                return
        dedup = self.dedup
        # Recorded here unless the transaction committed the record; a dedup store apart
        # from the store (Redis) cannot join it, so it is marked after the commit too.
        if self.spec.idempotent and (not ctx._committed or dedup is not self.host.store.dedup):
            await self._compensations.mark(dedup, env_id, self.stats)
        self._lookups.forget(env_id)  # recorded: a verdict of "not seen" no longer holds
        self.stats.handled += 1
        if self.observe_handled is not None:
            fields = ctx._fields
            sent = fields["time"] if fields is not None else ctx.envelope.time
            self.observe_handled(time.time() - sent.timestamp())
        if self._failures:
            self._failures = 0
            self._log.clear("infrastructure")
        await self._ack(delivery, env_id, tracked)

    async def _ack(self, delivery: Delivery, env_id: str, tracked: bool) -> None:
        """Ack, forgetting the attempt record first if ``tracked`` (it may have one): a process
        stopped between the two then leaves a message the broker redelivers (whose handling
        clears the record), not a record of an acked message, which never comes back."""
        if tracked:
            await self._forget(env_id)
        await delivery.ack()

    async def _record_failure(self, env_id: str, error: BaseException) -> None:
        """Record a failed attempt of ``env_id`` (read back by its next delivery)."""
        text = f"{type(error).__name__}: {error}"
        await self.host.store.attempts.failed(self.group, env_id, text)
        self._bounded_put(self._recorded, env_id)

    async def give_back(self, deliveries: Sequence[Delivery], exc: Exception) -> None:
        """Survive a failure around the handler (dedup store, commit, dead-letter store,
        broker ack): no attempt of the message is spent. Give it back untouched with the ones
        fetched behind it (their order kept), and pause with a backoff of its own."""
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
        for delivery in deliveries:
            try:
                await delivery.release()
            except Exception as give_back_error:  # the broker redelivers it anyway
                _log.warning("%s: could not give a delivery back: %s", self.name, give_back_error)
        await asyncio.sleep(delay)

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
        self._deferred.pop(env_id, None)
        try:
            await self.host.store.attempts.clear(self.group, env_id)
        except Exception as exc:
            self._log.warning(
                "forget", "%s: could not clear the attempts of %s: %s", self.name, env_id, exc
            )
