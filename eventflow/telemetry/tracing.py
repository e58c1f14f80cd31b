"""OpenTelemetry spans of one app (imported only when its tracing is on).

Spans, named and attributed by the OpenTelemetry messaging semantic conventions:

- ``send <topic>`` (PRODUCER): a message handed to the broker (``app.publish``, what a
  handler published outside ``ctx.transaction()``), or written to the outbox inside the
  handling's transaction (``eventflow.outbox`` = true). The envelope's ``traceparent`` is
  this span's context (set just before the bytes are made), so the consumer's span is its
  child; inside a handler it is a child of the handler's ``process`` span.
- ``relay <topic>`` (INTERNAL): the outbox relay's broker send of one outbox row, a child of
  the context the row's envelope carries (its ``send`` span).
- ``process <topic>`` (CONSUMER): one delivery handled by one group, from the dedup check
  to the ack, a child of the context in the envelope's ``traceparent``. A failed attempt that
  is retried is an exception event on it; a delivery that ends dead-lettered or given back
  (``RetryLater``), or that fails around the handler, sets ``error.type`` and an error
  status.
- ``append <stream category>`` (INTERNAL), ``project <name>`` (INTERNAL, one batch),
  ``saga <name>`` (INTERNAL, one transition with ``eventflow.saga.name``, ``.key``,
  ``.step``, ``.status``).

Propagation is OpenTelemetry's global text-map propagator (W3C trace context unless the
process configured another), into and out of the envelope's ``headers``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import orjson
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context as OtelContext
from opentelemetry.trace import (
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanKind,
    Status,
    StatusCode,
    TracerProvider,
)

from ..envelope import Envelope
from ..errors import ConfigurationError
from ..events import Event
from ..headers import TRACEPARENT_HEADER
from ..ports import EventStore, RecordedEvent, Snapshot
from ..sourcing.append import prepare_append

__all__ = ["TracedEvents", "Tracing", "configured_provider", "messaging_system"]

_SCOPE = "eventflow"
_TRACESTATE = "tracestate"
_SYSTEMS = {"memory": "memory", "nats": "nats", "tls": "nats", "kafka": "kafka"}
_ERROR_TYPE = "error.type"
_T = TypeVar("_T")

Publish = Callable[[str, Envelope], Awaitable[None]]
Add = Callable[[Sequence[tuple[str, Envelope]]], Awaitable[None]]


def configured_provider() -> TracerProvider | None:
    """The global tracer provider if one was set (not the API's proxy or no-op default)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, ProxyTracerProvider | NoOpTracerProvider):
        return None
    return provider


def messaging_system(broker_url: str) -> str:
    """``messaging.system`` of a broker URL: ``memory``, ``nats`` or ``kafka`` (else its
    scheme)."""
    scheme = urlsplit(broker_url).scheme
    return _SYSTEMS.get(scheme, scheme or "unknown")


def _error_type(exc: BaseException) -> str:
    cls = type(exc)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _fail(span: Span, exc: BaseException) -> None:
    """Mark ``span`` failed by ``exc``: the exception event, ``error.type``, error status."""
    span.record_exception(exc)
    span.set_attribute(_ERROR_TYPE, _error_type(exc))
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:256]))


class _Scope(Generic[_T]):
    """``with`` it: ``span`` is the current span for the block (entering gives ``value``);
    an exception that leaves the block (not a cancellation) marks it failed; it ends.
    A class, not a generator: it runs twice per message."""

    __slots__ = ("_span", "_token", "_value")

    def __init__(self, span: Span, value: _T) -> None:
        self._span = span
        self._value = value
        self._token: object = None

    def __enter__(self) -> _T:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._value

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        span = self._span
        try:
            if isinstance(exc, Exception):
                _fail(span, exc)
        finally:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            span.end()


def _carrying(env: Envelope, span: Span) -> Envelope:
    """``env`` with ``span``'s context as its trace headers (an earlier one replaced)."""
    headers = {k: v for k, v in env.headers.items() if k != _TRACESTATE}
    propagate.inject(headers, context=trace.set_span_in_context(span))
    return env.model_copy(update={"headers": headers})


def _parent(headers: Mapping[str, str] | None) -> OtelContext:
    """The context a message carries (an empty one, not the current, when it has none)."""
    return propagate.extract(headers) if headers else OtelContext()


def _category(stream_id: str) -> str:
    """A stream's category (``order`` of ``order-o-1``): span names stay few."""
    head, sep, _ = stream_id.partition("-")
    return head if sep else stream_id


class Tracing:
    """Makes the spans of one app (see the module docstring)."""

    def __init__(self, provider: TracerProvider | None, *, broker_url: str) -> None:
        if provider is not None and not isinstance(provider, TracerProvider):
            raise ConfigurationError(
                f"App(tracing=...) takes None, True, False or an OpenTelemetry TracerProvider, "
                f"got {provider!r}"
            )
        from importlib.metadata import PackageNotFoundError, version

        try:
            own = version("eventflow")
        except PackageNotFoundError:  # run from a source tree
            own = None
        self.tracer = trace.get_tracer(_SCOPE, own, tracer_provider=provider)
        self.system = messaging_system(broker_url)

    # -- producing ---------------------------------------------------------------------------

    def _send_attributes(self, topic: str, env: Envelope) -> dict[str, Any]:
        return {
            "messaging.system": self.system,
            "messaging.operation.name": "send",
            "messaging.operation.type": "send",
            "messaging.destination.name": topic,
            "messaging.message.id": env.id,
            "messaging.message.conversation_id": env.correlation_id,
            "eventflow.message.type": env.type,
        }

    async def send(self, topic: str, env: Envelope, publish: Publish) -> Envelope:
        """Publish ``env`` with ``publish`` inside a ``send <topic>`` span whose context the
        envelope then carries; return the envelope as sent."""
        span = self.tracer.start_span(
            f"send {topic}", kind=SpanKind.PRODUCER, attributes=self._send_attributes(topic, env)
        )
        sent = _carrying(env, span)
        try:
            await publish(topic, sent)
        except Exception as exc:
            _fail(span, exc)
            raise
        finally:
            span.end()
        return sent

    def sending_stored(self, topic: str, env: Envelope) -> _Scope[Envelope]:
        """The event relay's ``send <topic>`` span of a stored event, a child of the context
        the event carries (where it was appended); entering gives the event carrying the span's."""
        attributes = self._send_attributes(topic, env)
        attributes["eventflow.event_relay"] = True
        span = self.tracer.start_span(
            f"send {topic}",
            context=_parent(env.headers if TRACEPARENT_HEADER in env.headers else None),
            kind=SpanKind.PRODUCER,
            attributes=attributes,
        )
        return _Scope(span, _carrying(env, span))

    async def send_to_outbox(self, messages: Sequence[tuple[str, Envelope]], add: Add) -> None:
        """Write ``messages`` to the outbox with ``add``, each in a ``send <topic>`` span
        (children of the current one, the handler's ``process``) whose context it carries."""
        spans: list[Span] = []
        carried: list[tuple[str, Envelope]] = []
        for topic, env in messages:
            attributes = self._send_attributes(topic, env)
            attributes["eventflow.outbox"] = True
            span = self.tracer.start_span(
                f"send {topic}", kind=SpanKind.PRODUCER, attributes=attributes
            )
            spans.append(span)
            carried.append((topic, _carrying(env, span)))
        try:
            await add(carried)
        except Exception as exc:
            for span in spans:
                _fail(span, exc)
            raise
        finally:
            for span in spans:
                span.end()

    def relaying(self, topic: str, payload: bytes, message_id: str) -> _Scope[Span]:
        """A ``relay <topic>`` span around the relay's send of one outbox row, a child of
        the context its envelope carries."""
        headers: Mapping[str, str] | None = None
        correlation = None
        try:
            raw = orjson.loads(payload)
            headers, correlation = raw.get("headers"), raw.get("correlation_id")
        except (orjson.JSONDecodeError, AttributeError):
            pass  # not an envelope: a span of its own
        attributes: dict[str, Any] = {
            "messaging.system": self.system,
            "messaging.operation.name": "send",
            "messaging.operation.type": "send",
            "messaging.destination.name": topic,
            "messaging.message.id": message_id,
            "eventflow.outbox": True,
        }
        if isinstance(correlation, str):
            attributes["messaging.message.conversation_id"] = correlation
        span = self.tracer.start_span(
            f"relay {topic}",
            context=_parent(headers if isinstance(headers, dict) else None),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
        )
        return _Scope(span, span)

    # -- consuming ---------------------------------------------------------------------------

    def processing(
        self,
        topic: str,
        fields: Mapping[str, Any],
        group: str,
        metadata: Mapping[str, Any],
    ) -> _Scope[Span]:
        """The ``process <topic>`` span of one delivery (``fields``: its envelope's checked
        wire fields), a child of the producer's context from its ``traceparent``."""
        attributes: dict[str, Any] = {
            "messaging.system": self.system,
            "messaging.operation.name": "process",
            "messaging.operation.type": "process",
            "messaging.destination.name": topic,
            "messaging.consumer.group.name": group,
            "messaging.message.id": fields["id"],
            "messaging.message.conversation_id": fields["correlation_id"],
            "eventflow.message.type": fields["type"],
        }
        partition = metadata.get("partition")
        if partition is not None:
            attributes["messaging.destination.partition.id"] = str(partition)
        headers = fields["headers"]
        span = self.tracer.start_span(
            f"process {topic}",
            context=_parent(headers if TRACEPARENT_HEADER in headers else None),
            kind=SpanKind.CONSUMER,
            attributes=attributes,
        )
        return _Scope(span, span)

    @staticmethod
    def attempt_failed(error: BaseException, attempt: int, given_back: bool) -> None:
        """A handler attempt failed and will be retried: an exception event on the current
        (``process``) span. Retried in place, its status stays unset (a later attempt may
        succeed); ``given_back`` to the broker (``RetryLater``), this delivery's processing
        ends failed: ``error.type`` and an error status."""
        span = trace.get_current_span()
        span.record_exception(error, attributes={"eventflow.attempt": attempt})
        if given_back:
            span.set_attribute(_ERROR_TYPE, _error_type(error))
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:256]))

    @staticmethod
    def failed(error: BaseException) -> None:
        """The current delivery ends failed (dead-lettered, given back for later): mark the
        current (``process``) span."""
        _fail(trace.get_current_span(), error)

    # -- store, projections, sagas -----------------------------------------------------------

    def events(self, store: EventStore) -> TracedEvents:
        """``store`` seen through this tracing: each append is an ``append`` span."""
        return TracedEvents(store, self)

    def appending(self, stream_id: str, expected_version: int | None) -> _Scope[Span]:
        """The ``append <category>`` span of one append to the event store."""
        attributes: dict[str, Any] = {"eventflow.stream.id": stream_id}
        if expected_version is not None:
            attributes["eventflow.expected_version"] = expected_version
        span = self.tracer.start_span(
            f"append {_category(stream_id)}", kind=SpanKind.INTERNAL, attributes=attributes
        )
        return _Scope(span, span)

    def projecting(self, name: str, count: int, first: int, last: int) -> _Scope[Span]:
        """The ``project <name>`` span of one projection batch (store positions
        ``first``..``last``)."""
        span = self.tracer.start_span(
            f"project {name}",
            kind=SpanKind.INTERNAL,
            attributes={
                "eventflow.projection.name": name,
                "eventflow.events.count": count,
                "eventflow.position.first": first,
                "eventflow.position.last": last,
            },
        )
        return _Scope(span, span)

    def saga(self, name: str, key: str) -> _Scope[Span]:
        """The ``saga <name>`` span of one transition of the saga ``key``; the caller adds
        ``eventflow.saga.step`` and ``.status`` once it knows them (:meth:`saga_state`)."""
        span = self.tracer.start_span(
            f"saga {name}",
            kind=SpanKind.INTERNAL,
            attributes={"eventflow.saga.name": name, "eventflow.saga.key": key},
        )
        return _Scope(span, span)

    @staticmethod
    def saga_state(span: Span, step: str | None, status: str) -> None:
        """The step the saga is at after the transition, and its status."""
        if step is not None:
            span.set_attribute("eventflow.saga.step", step)
        span.set_attribute("eventflow.saga.status", status)


class TracedEvents:
    """An event store whose appends are ``append <category>`` spans: what ``ctx.store`` and
    ``app.repository`` use while tracing is on. Everything else goes to the store as is."""

    def __init__(self, store: EventStore, tracing: Tracing) -> None:
        self._store = store
        self._tracing = tracing

    def __getattr__(self, name: str) -> Any:
        """What the port does not name goes to the store itself, so code that reached past
        ``EventStore`` on ``ctx.store`` works the same with tracing on."""
        return getattr(self._store, name)

    async def append(
        self,
        stream_id: str,
        events: Sequence[Event | Envelope],
        *,
        expected_version: int | None = None,
    ) -> int:
        """``EventStore.append`` in a span (``eventflow.stream.version``: the new version).
        An ``Event`` gets the span's context as its ``traceparent`` (the event relay's send
        continues it); an ``Envelope`` keeps its own."""
        with self._tracing.appending(stream_id, expected_version) as span:
            envelopes = [
                env if isinstance(given, Envelope) else _carrying(env, span)
                for given, env in zip(events, prepare_append(stream_id, events), strict=True)
            ]
            span.set_attribute("eventflow.events.count", len(envelopes))
            version = await self._store.append(
                stream_id, envelopes, expected_version=expected_version
            )
            span.set_attribute("eventflow.stream.version", version)
            return version

    def read_stream(
        self,
        stream_id: str,
        *,
        from_version: int | None = None,
        backwards: bool = False,
        limit: int | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        """``EventStore.read_stream``."""
        return self._store.read_stream(
            stream_id, from_version=from_version, backwards=backwards, limit=limit
        )

    def read_all(self, *, after: int = 0, limit: int | None = None) -> AsyncIterator[RecordedEvent]:
        """``EventStore.read_all``."""
        return self._store.read_all(after=after, limit=limit)

    def subscribe(self, *, after: int = 0) -> AsyncIterator[RecordedEvent]:
        """``EventStore.subscribe``."""
        return self._store.subscribe(after=after)

    async def stream_version(self, stream_id: str) -> int:
        """``EventStore.stream_version``."""
        return await self._store.stream_version(stream_id)

    async def last_position(self) -> int:
        """``EventStore.last_position``."""
        return await self._store.last_position()

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        """``EventStore.save_snapshot``."""
        await self._store.save_snapshot(snapshot)

    async def load_snapshot(self, stream_id: str) -> Snapshot | None:
        """``EventStore.load_snapshot``."""
        return await self._store.load_snapshot(stream_id)
