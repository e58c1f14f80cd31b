"""``Context``: what a handler gets besides its event."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

from .envelope import Envelope, derived_id
from .events import Event, envelope_for, to_envelope
from .fanout import Call, Gathered, gather
from .headers import COMPENSATES_HEADER, TRACEPARENT_HEADER
from .limits.limiter import Taken
from .patterns import validate_topic
from .ports import EventStore, Transaction
from .runtime.host import ConsumerHost

__all__ = ["IDEMPOTENCY_NAMESPACE", "Context", "idempotency_key"]

T = TypeVar("T")

IDEMPOTENCY_NAMESPACE = uuid.UUID("5b0d7e4e-2f0a-5c1e-9a57-0e7e9f1d2a61")
"""The namespace of :func:`idempotency_key`'s name-based UUIDs (fixed for good: changing it
would change every key, and a provider would take a retry for a new request)."""


def idempotency_key(group: str, envelope_id: str) -> str:
    """The idempotency key of the message ``envelope_id`` in ``group``: a name-based UUID
    (version 5) of the two, so every process computes the same one, for every delivery."""
    return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, f"{group}\x00{envelope_id}"))


class Context:
    """The handling of one message by one group: its envelope, the attempt, and publishing.

    ``publish`` continues the business transaction: the new envelope inherits the
    ``correlation_id``, gets ``causation_id = ctx.envelope.id`` and a child ``traceparent``.
    Messages published here are sent when the handler succeeds, before the message is
    acknowledged; a failed or timed-out attempt sends nothing. Their ids are derived from
    the handled envelope, the group and the event type, so if the handler runs again on the
    same message (a crash before the ack), it publishes the same ids and downstream dedup
    drops the copies.
    """

    # Class-level defaults, replaced per instance on first use: most handlings publish
    # nothing and open no transaction, so a Context costs a few attribute writes.
    _outbox: list[tuple[str, Envelope]] | None = None
    _counts: dict[str, int] | None = None
    _tx: Transaction | None = None
    _committed = False
    _tx_failed: BaseException | None = None
    _tx_scope: AbstractAsyncContextManager[Transaction] | None = None
    _commit_hooks: list[Callable[[], None]] | None = None
    _events: EventStore | None = None  # the store seen through the app's tracing, if on

    def __init__(
        self,
        app: ConsumerHost,
        envelope: Envelope | None,
        group: str,
        attempt: int,
        *,
        fields: dict[str, Any] | None = None,
    ) -> None:
        """``envelope`` is the message being handled; the consumer may pass None and the
        envelope's checked wire ``fields`` instead, and the envelope is built from them the
        first time something reads it (most handlers never do)."""
        if envelope is None and fields is None:
            raise TypeError("Context needs the envelope or its fields")
        self._app = app
        self._envelope = envelope
        self._fields = fields
        self.group = group
        self.attempt = attempt

    @property
    def envelope(self) -> Envelope:
        """The message being handled."""
        env = self._envelope
        if env is None:
            assert self._fields is not None  # checked in __init__
            env = self._envelope = Envelope._trusted(self._fields)
        return env

    @property
    def idempotency_key(self) -> str:
        """A key for this message in this group, to pass to a provider that accepts
        idempotency keys (``Idempotency-Key: ...``), so a retried call is not done twice.

        The same for every delivery, attempt, redelivery after a crash or restart, relay,
        and dead-letter replay of this message in this group (it is derived from the
        envelope id, which all of these keep, and the group's name); different for another
        message, and for the same message in another group. A UUID string (36 characters),
        which providers that want a UUID or a short opaque string both accept."""
        fields = self._fields
        env_id: str = fields["id"] if fields is not None else self.envelope.id
        return idempotency_key(self.group, env_id)

    @property
    def compensates(self) -> str | None:
        """The envelope id of the command this message undoes (its ``eventflow-compensates``
        header), or None when it is no compensation. A compensation whose handler runs is
        one whose command this group handled: one that reaches the group first cancels the
        command instead, and its handler is not called. Still write it to cope with nothing
        to undo (the command may have been rejected, or handled without effect, or its dedup
        record may have expired) and to be retried."""
        headers = self._fields["headers"] if self._fields is not None else self.envelope.headers
        value: str | None = headers.get(COMPENSATES_HEADER)
        return value

    def transaction(self) -> AbstractAsyncContextManager[Transaction]:
        """The store transaction of this handling (SQL stores: your SQL runs in it).

        Opened on first use and kept open until the handler returns: eventflow then writes
        the dedup entry and the messages ``publish`` queued into the same transaction and
        commits, so your writes, the dedup entry and the outgoing messages happen exactly
        once together (a transactional inbox and outbox; a relay sends the messages). If
        the handler raises or times out, everything rolls back. Entering it again in the
        same handling gives the same transaction.

        It commits: your writes (``tx.execute``, and ``ctx.store`` appends made inside the
        block) + this message's dedup entry + the messages ``ctx.publish`` queued. A
        transaction opened on the store on its own (``ctx.app.store.transaction()`` outside
        this one) commits only your writes, when its block exits: no dedup entry, no
        outgoing messages.
        """
        return self._enter_transaction()

    @asynccontextmanager
    async def _enter_transaction(self) -> AsyncIterator[Transaction]:
        if self._tx is None:
            scope = self._app.store.transaction()
            self._tx = await scope.__aenter__()
            self._tx_scope = scope
        try:
            yield self._tx
        except BaseException as exc:
            # The block failed: the transaction must not commit, even if the handler
            # catches the error and returns normally.
            self._tx_failed = exc
            raise

    def _after_commit(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` once this handling's transaction committed (eventflow's own
        wake-ups, e.g. the saga timer loop's); never when it rolls back."""
        if self._commit_hooks is None:
            self._commit_hooks = []
        self._commit_hooks.append(hook)

    async def _finish_transaction(self, error: BaseException | None) -> None:
        """Commit (``error`` None) or roll back the handling's transaction, if one is open;
        after a commit, run the hooks of ``_after_commit``."""
        scope, self._tx_scope, self._tx = self._tx_scope, None, None
        hooks, self._commit_hooks = self._commit_hooks, None
        if scope is None:
            return
        if error is None:
            await scope.__aexit__(None, None, None)
            for hook in hooks or ():
                hook()
        else:
            await scope.__aexit__(type(error), error, error.__traceback__)

    @property
    def app(self) -> ConsumerHost:
        """The app running this handler (an ``App``, typed as what the consumer needs of it:
        name, broker, store, dedup, registry)."""
        return self._app

    @property
    def store(self) -> EventStore:
        """The app's event store: append and read events. Inside ``async with
        ctx.transaction()`` an append joins the handling's transaction and commits with it.

        Typed as the ``EventStore`` port, without ``transaction()`` on purpose: a store
        transaction is not this handling's. ``ctx.transaction()`` commits your writes + the
        dedup entry + the queued messages together; a ``store.transaction()`` of its own
        (still there on ``ctx.app.store``) commits only your writes, so a crash after it and
        before the message is marked handled re-runs the handler: its writes happen twice."""
        events = self._events
        return self._app.store if events is None else events

    async def publish(
        self,
        message: Event | Envelope,
        *,
        key: str | None = None,
        topic: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Envelope:
        """Queue ``message`` for publishing once this attempt succeeds; return its envelope.

        An event keeps the handled message's key unless ``key`` is given, so what follows
        from one entity's message (a reply, the next step) is handled in order with it; an
        ``Envelope`` is sent as it is, with ``key`` and ``headers`` applied if given."""
        if topic is not None:
            validate_topic(topic)  # a bad topic fails this attempt, not the relay or the app
        parent = self.envelope
        if isinstance(message, Event):
            # The n-th message of a type published while handling this envelope in this
            # group always gets the same id, so a re-run after a crash is deduplicated.
            counts = self._counts
            if counts is None:
                counts = self._counts = {}
            n = counts[message.event_type] = counts.get(message.event_type, 0) + 1
            env = envelope_for(
                message,
                source=self._app.name,
                key=key if key is not None else parent.key,  # the same entity, in order
                headers=headers,
                correlation_id=parent.correlation_id,
                causation_id=parent.id,
                parent_traceparent=parent.headers.get(TRACEPARENT_HEADER),
                id=derived_id(parent, self.group, message.event_type, str(n)),
            )
        else:
            # An Envelope is sent as it is (its id and correlation too), but for the key and
            # headers given here.
            env = to_envelope(message, source=self._app.name).overridden(key=key, headers=headers)
        if self._outbox is None:
            self._outbox = []
        self._outbox.append((topic or env.type, env))
        return env

    def limit(self, name: str, *, timeout: float | None = None) -> Taken:
        """``async with ctx.limit("payments-api"):`` takes a slot (and a rate token) of the
        app's limit ``name`` for the block, and passes its circuit breaker.

        Waiting is bounded by the limit's ``timeout`` (or ``timeout`` here); past it, or
        while the breaker is open, it raises an error that gives the message back without
        spending an attempt (``LimitTimeoutError``, ``CircuitOpenError``: let it leave the
        handler). The breaker counts the exceptions of its ``on`` types that leave the block;
        one it counts spends the attempt only while the breaker stays closed. A name the
        app does not declare raises ``ConfigurationError``."""
        return self._app.limits.take(name, timeout)

    async def gather(
        self,
        calls: Iterable[Call[T]],
        limit: int = 10,
        *,
        limit_name: str | None = None,
        limit_timeout: float | None = None,
    ) -> Gathered[T]:
        """``await ctx.gather(calls, limit=10)`` runs the calls (coroutines, or functions of
        no arguments) with at most ``limit`` at once and returns one result per call, in
        order: ``.ok``, ``.value``, ``.error``. A failing call does not stop the others;
        ``results.raise_if_failed()`` returns the values or raises one of the failures.
        Cancelling the handler (its soft ``timeout``) cancels every call still running.

        ``limit_name="payments-api"`` enters ``ctx.limit("payments-api",
        timeout=limit_timeout)`` around each call, so the declared limit (cluster-wide, with
        its breaker) bounds them too; a call refused by it gets ``CircuitOpenError`` or
        ``LimitTimeoutError`` as its result. A name the app does not declare raises
        ``ConfigurationError`` before any call begins."""
        if limit_name is None:
            return await gather(calls, limit)
        name, limits = limit_name, self._app.limits
        return await gather(calls, limit, take=lambda: limits.take(name, limit_timeout))

    def _take_outbox(self) -> list[tuple[str, Envelope]]:
        out, self._outbox = self._outbox or [], None
        return out
