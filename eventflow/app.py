"""``App``: wires handlers to a broker and a store, and owns every task it starts.

Lifecycle: ``async with app`` (or ``app.run()``) starts the broker and store, joins every
subscription (and returns only once they are all live), then runs the consumers and the
heartbeat in one ``asyncio.TaskGroup``. Leaving stops fetching, drains in-flight handlers
within ``grace_period`` and closes the subscriptions so unacked messages are redelivered.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ._logging import Throttled
from .brokers import open_broker
from .envelope import Envelope, new_id
from .errors import BrokerError, ComponentFailedError, ConfigurationError, MessageRefusedError
from .events import Event, EventRegistry, default_registry, envelope_for, to_envelope
from .groups import GroupSpec
from .headers import MESSAGE_ID_HEADER
from .limits import Limits
from .metrics.wiring import Observability
from .patterns import validate_topic
from .ports import Broker, DedupStore, Store, declared
from .projections import Projection, ProjectionRunner
from .runtime.checks import check_catch_up_limit, check_groups, checked_projections
from .runtime.consumer import Consumer
from .runtime.deadletters import DeadLetters
from .runtime.health import app_health
from .runtime.heartbeat import DEFAULT_HEARTBEAT_INTERVAL, Heartbeater
from .runtime.idle import DEFAULT_IDLE_TIMEOUT
from .runtime.idle import wait_idle as wait_for_idle
from .runtime.relay import RELAY_GROUPS, EventRelay, OutboxRelay
from .runtime.requests import Requests
from .runtime.serving import serve_app
from .runtime.stall import DEFAULT_LOOP_BLOCK_WARNING, StallGuard, check_loop_block_warning
from .sagas.runtime import DEFAULT_CATCH_UP_LIMIT, SagaRuntime, Sagas
from .sourcing.aggregate import Aggregate
from .sourcing.repository import Repository
from .stores import dedup_for, store_for
from .subscribe import check_reachable, collect_handlers, inspect_handler
from .supervision import Component, Health, RestartPolicy, Supervisor
from .telemetry import TracingSetting, tracing_for

if TYPE_CHECKING:
    from .metrics.registry import AppMetrics
    from .telemetry.tracing import Tracing

__all__ = ["DEFAULT_GRACE_PERIOD", "MESSAGE_ID_HEADER", "App"]

DEFAULT_GRACE_PERIOD = 10.0
_log = logging.getLogger("eventflow.app")
_DRAIN_MARGIN = 1.0  # seconds past the grace period a draining consumer gets to close
_SEND_RETRY = 0.05
_SEND_RETRY_MAX = 5.0
_A = TypeVar("_A", bound=Aggregate)


class App:
    """An event-driven service: a name, a broker, a store and its handlers.

    ``broker`` and ``store`` take a URL or an adapter instance. ``dedup`` defaults to the
    store's dedup table (or a ``DedupStore`` / ``redis://host:6379/0`` URL). ``handlers``
    lists ``@subscribe`` functions or modules of them.
    ``projections`` lists ``Projection`` instances, each run by one instance at a time
    across processes. ``sagas`` lists ``Saga`` classes this app runs (their handlers join
    the groups ``saga.<name>``; their timers fire on one instance at a time); ``app.sagas``
    reads any saga in the store. ``catch_up_limit`` (seconds, 30 by default) bounds how long
    a due saga deadline waits, past it (or past this app's start, for one that passed
    before), for the messages of the saga's group the broker accepted before it to be
    handled (a reply already in the broker wins over the deadline); keep it above the
    broker's failover time (see ``docs/sagas.md``).
    The app relays the store's outbox (messages published inside
    ``ctx.transaction()``) to the broker; with ``relay_events=True`` it also publishes every
    event appended to the store (topic = type, key = stream id), in order per stream.
    ``restart_policy`` says how its components are restarted after transient failures and
    when one has failed for good (see :class:`~eventflow.supervision.RestartPolicy`).
    ``loop_block_warning`` (seconds, 1.0 by default; None: off): a watchdog thread logs the
    stack of whatever blocks the event loop for that long; the same thread enforces the
    handlers' ``hard_timeout`` (see ``docs/downstream.md``).
    ``limits`` lists ``Limit`` declarations that handlers take with ``ctx.limit(name)``
    (concurrency, rate and a circuit breaker per dependency; see ``docs/downstream.md``).
    ``tracing``: OpenTelemetry spans (``eventflow[otel]``). None (the default) traces when
    opentelemetry is imported and a tracer provider is set when the app starts; True
    traces with the global provider; False never; a ``TracerProvider`` traces with it
    (see ``docs/observability.md``).
    ``http_port`` (None: none; 0: any free port) serves ``/healthz``, ``/readyz`` and
    ``/metrics`` on ``http_host`` (see ``docs/observability.md``). ``metrics`` keeps the
    Prometheus metrics (``app.metrics``; needs ``eventflow[prometheus]``): True on, False
    off, None (the default) on when there is an ``http_port`` and the extra is installed.
    ``meter_provider`` (an OpenTelemetry ``MeterProvider``) reports the same metrics to it.
    """

    def __init__(
        self,
        name: str,
        *,
        broker: str | Broker = "memory://",
        store: str | Store = "memory://",
        handlers: Iterable[object] = (),
        projections: Iterable[Projection] = (),
        sagas: Iterable[type] = (),
        relay_events: bool = False,
        dedup: str | DedupStore | None = None,
        registry: EventRegistry | None = None,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        restart_policy: RestartPolicy | None = None,
        catch_up_limit: float = DEFAULT_CATCH_UP_LIMIT,
        loop_block_warning: float | None = DEFAULT_LOOP_BLOCK_WARNING,
        limits: Iterable[object] = (),
        tracing: TracingSetting = None,
        http_port: int | None = None,
        http_host: str = "0.0.0.0",
        metrics: bool | None = None,
        meter_provider: Any = None,
    ) -> None:
        if not name or any(c in name for c in " \t\n"):
            raise ConfigurationError(f"app name {name!r} must be non-empty without spaces")
        check_catch_up_limit(catch_up_limit)
        self.name = name
        self.broker: Broker = open_broker(broker)
        self.store: Store = store_for(store)
        self.registry = registry or default_registry
        self.limits = Limits(limits, app=name)
        """The declared limits, which handlers take with ``ctx.limit(name)``."""
        self.grace_period = grace_period
        self.heartbeat_interval = heartbeat_interval
        self.instance = f"{name}@{socket.gethostname()}:{os.getpid()}:{new_id()[-12:]}"
        self._dedup_override = dedup_for(dedup) if dedup is not None else None
        self.sagas = Sagas(self.store, self.registry, name)
        self._saga_runtime = SagaRuntime(
            sagas, self.sagas, self.registry, catch_up_limit=float(catch_up_limit)
        )
        self._specs = collect_handlers(handlers) + self._saga_runtime.handler_specs()
        self._bindings = [
            (spec, spec.group or name, inspect_handler(spec.fn)) for spec in self._specs
        ]
        check_reachable((spec, signature) for spec, _, signature in self._bindings)
        check_groups((spec, group) for spec, group, _ in self._bindings)
        self.projections: tuple[Projection, ...] = checked_projections(projections)
        self.relay_events = relay_events
        self.loop_block_warning = check_loop_block_warning(loop_block_warning)
        self._guard: StallGuard | None = None
        self.restart_policy = restart_policy or RestartPolicy()
        self._projection_runners: list[ProjectionRunner] = []
        self._relays: list[OutboxRelay | EventRelay] = []
        self._consumers: list[Consumer] = []
        self._draining: list[Component] = []  # the consumers' components
        self._supervisor: Supervisor | None = None
        self._failure: ComponentFailedError | None = None
        self._heartbeater: Heartbeater | None = None
        self._started = False
        self._lock = asyncio.Lock()
        self._log = Throttled(_log)
        self._requests = Requests(self, lambda: self._supervisor if self._started else None)
        # None: off (tested with `is not None` on the hot paths). Automatic: decided at start.
        self._tracing_auto = tracing is None
        self._tracing: Tracing | None = (
            None if tracing is None else tracing_for(tracing, broker_url=self.broker.url)
        )
        self.http_port = http_port
        """The health and metrics port (None: none); ``eventflow run --port`` sets it."""
        self.http_host = http_host
        self._seen = Observability(
            self,
            self._saga_runtime,
            name=name,
            metrics=metrics,
            meter_provider=meter_provider,
        )

    # -- public surface --------------------------------------------------------------------

    @property
    def dedup(self) -> DedupStore:
        """The dedup store used by this app's idempotent handlers."""
        # `is None`, not `or`: a store may be falsy (an empty MemoryDedupStore has len 0).
        return self.store.dedup if self._dedup_override is None else self._dedup_override

    @property
    def groups(self) -> tuple[str, ...]:
        """The consumer groups of this app's handlers."""
        return tuple(dict.fromkeys(group for _, group, _ in self._bindings))

    @property
    def subscriptions(self) -> tuple[GroupSpec, ...]:
        """Every (group, pattern) this app's handlers and sagas join, with where the group
        begins if it does not exist yet: what ``eventflow groups declare`` creates."""
        return tuple(
            dict.fromkeys(
                GroupSpec(group, spec.pattern, spec.start) for spec, group, _ in self._bindings
            )
        )

    @property
    def dead_letter_groups(self) -> tuple[str, ...] | None:
        """The groups whose dead letters are this app's: its consumer groups, and those of
        the messages its relays parked (the broker refused them for every group). None for
        an app without handlers: every group's."""
        return (*self.groups, *sorted(RELAY_GROUPS)) if self.groups else None

    @property
    def dead_letters(self) -> DeadLetters:
        """The dead letters of this app's groups: ``list``, ``get``, ``replay``, ``purge``."""
        return DeadLetters(self.store.dead_letters, self.broker, self.dead_letter_groups)

    def repository(
        self,
        cls: type[_A],
        *,
        snapshot_every: int | None = None,
        stream_prefix: str | None = None,
    ) -> Repository[_A]:
        """A ``Repository`` of ``cls`` aggregates in this app's store; the events it saves
        carry the app's name as their source, and it loads with the app's registry. Use it
        once the app is started (the store is open): inside ``async with app`` or a
        handler."""
        return Repository(
            cls,
            self.store if self._tracing is None else self._tracing.events(self.store),
            snapshot_every=snapshot_every,
            stream_prefix=stream_prefix,
            source=self.name,
            registry=self.registry,
        )

    @property
    def projection_runners(self) -> Sequence[ProjectionRunner]:
        """The running projection runners (empty before start): ``active``, ``failures``."""
        return tuple(self._projection_runners)

    @property
    def consumers(self) -> Sequence[Consumer]:
        """The running consumers (empty before start)."""
        return tuple(self._consumers)

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per consumer (``group:pattern``): received, handled, duplicates, ...;
        and per declared limit (``limit:<name>``): entered, timed_out, refused, counted,
        in_use, and with a breaker ``breaker_open`` (0 closed, 1 open, 2 half-open),
        ``opened``, ``closed``; once ``request`` was called, ``requests``: sent, replied,
        timed_out, late (replies dropped after their request gave up), skipped."""
        found = {c.name: c.stats.as_dict() for c in self._consumers}
        if self._requests.stats.sent:
            found["requests"] = self._requests.stats.as_dict()
        for name, row in self.limits.stats().items():
            found[f"limit:{name}"] = row
        return found

    async def publish(
        self,
        message: Event | Envelope,
        *,
        key: str | None = None,
        topic: str | None = None,
        headers: Mapping[str, str] | None = None,
        correlation_id: str | None = None,
    ) -> Envelope:
        """Publish an event (to the topic named by its type unless ``topic``); return its envelope.

        Starts a new correlation (the new envelope's id) unless ``correlation_id`` is given.
        An ``Envelope`` is published keeping its id (and its fields, except those given here).

        Raises ``PublishUnconfirmedError`` when the broker may have stored the message
        without confirming it (maybe sent: it may be delivered), ``MessageRefusedError``
        when it refuses it for good, another ``BrokerError`` or ``BackpressureError`` when
        it was not sent. Publishing the same ``Envelope`` again is safe in every case: its
        id makes a second copy a duplicate that consumers drop.
        """
        if isinstance(message, Event):
            env = envelope_for(
                message,
                source=self.name,
                key=key,
                headers=headers,
                correlation_id=correlation_id,
            )
        else:  # an Envelope keeps its id; to_envelope refuses anything else
            env = to_envelope(message, source=self.name).overridden(
                key=key, headers=headers, correlation_id=correlation_id
            )
        if topic is None:
            topic = env.type
        else:
            validate_topic(topic)
        return await self._send(topic, env)

    async def request(
        self,
        message: Event,
        *,
        expect: object,
        timeout: float,
        key: str | None = None,
        topic: str | None = None,
        headers: Mapping[str, str] | None = None,
        correlation_id: str | None = None,
    ) -> Any:
        """Publish the command ``message`` as ``publish`` does and return the first message
        it caused (``causation_id`` = its id) of a type in ``expect`` (an Event class or a
        union), decoded to its class. Participants answer with an ordinary ``ctx.publish``.

        ``reply = await app.request(ReserveStock(...), expect=StockReserved |
        StockRejected, timeout=5.0)``. No such reply within ``timeout`` seconds raises
        ``RequestTimeoutError``; the command stays sent, and a reply that comes later is
        dropped and counted (``stats()["requests"]["late"]``). The first request for a reply
        topic joins this app object's own reply group on it, before the command is sent;
        replies to other instances are skipped without being decoded (see
        ``docs/api.md``, "Request-reply"). Publishing errors are ``publish``'s."""
        return await self._requests.request(
            message,
            expect=expect,
            timeout=timeout,
            key=key,
            topic=topic,
            headers=headers,
            correlation_id=correlation_id,
        )

    def _not_running(self) -> None:
        raise BrokerError(
            f"app {self.name!r} is not running: publish inside `async with app:` "
            "or after `await app.start()`"
        )

    async def _send(self, topic: str, env: Envelope) -> Envelope:
        """Send ``env`` to ``topic``; return it as sent (traced: carrying its send span)."""
        if not self._started:
            self._not_running()
        if self._tracing is not None:
            return await self._tracing.send(topic, env, self._publish)
        # The same send as _publish's, inline: the untraced path awaits no extra coroutine.
        await self.broker.publish(
            topic, env.to_bytes(), key=env.key, headers={MESSAGE_ID_HEADER: env.id}
        )
        return env

    async def _publish(self, topic: str, env: Envelope) -> None:
        """The broker send of ``_send`` (what the tracing's send span wraps)."""
        await self.broker.publish(
            topic, env.to_bytes(), key=env.key, headers={MESSAGE_ID_HEADER: env.id}
        )

    async def send_outgoing(self, messages: Sequence[tuple[str, Envelope]]) -> None:
        """Send ``(topic, envelope)`` pairs a handler published, in order; retry a send that
        may pass (the broker is down) with backoff until it goes (ids are fixed, so a copy
        sent twice is dropped downstream). A message the broker refuses for good raises
        ``MessageRefusedError``. The consumer calls it once a handler succeeded."""
        delay = _SEND_RETRY
        for topic, env in messages:
            while True:
                try:
                    await self._send(topic, env)
                    break
                except MessageRefusedError:
                    raise
                except ConfigurationError as exc:  # the broker can never send it as it is
                    raise MessageRefusedError(
                        f"the broker cannot send {env.id} to {topic!r}: {exc}"
                    ) from exc
                except Exception as exc:
                    self._log.warning(
                        f"send:{topic}",
                        "publishing %s to %s failed (%s); retrying until it goes",
                        env.id,
                        topic,
                        exc,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _SEND_RETRY_MAX)

    async def wait_idle(self, *, timeout: float = DEFAULT_IDLE_TIMEOUT) -> None:
        """Return once everything published so far that this app's subscriptions receive
        (and what their handlers published in turn, directly or through the outbox) has
        been handled or dead-lettered: every subscription's broker lag is zero with nothing
        in flight, the outbox has no pending row and every projection has caught up, in two
        looks in a row with no handling in between (``eventflow.runtime.idle``, and
        ``docs/testing.md``). Raises ``IdleTimeoutError`` naming what is still busy after
        ``timeout`` seconds, and the app's ``failure`` if a component failed."""
        await wait_for_idle(
            self._consumers,
            self.store,
            [p.name for p in self.projections],
            timeout=timeout,
            check=self._check_running,
            name=f"app {self.name!r}",
        )

    def _check_running(self) -> None:
        if self._failure is not None:
            raise self._failure
        if not self._started:
            raise ConfigurationError(
                f"app {self.name!r} is not running: call wait_idle inside `async with app:`"
            )

    # -- health ------------------------------------------------------------------------------

    def health(self) -> Health:
        """``ok``, ``degraded`` (a component is failing and being restarted), ``failed`` (one
        cannot recover: see ``failure``) or ``stopped``, with a line per component not well."""
        supervisor = self._supervisor
        if supervisor is None:
            return Health("stopped")
        return app_health(supervisor, self.broker, self._projection_runners, self.limits)

    def readiness(self) -> tuple[bool, Health]:
        """Whether the app is ready (``/readyz``): started, so every subscription is live,
        and healthy; with the health that says why not (``starting`` while it joins)."""
        health = self.health()
        if not self._started and health.ok:
            return False, Health("starting")
        return self._started and health.ok, health

    @property
    def metrics(self) -> AppMetrics | None:
        """The app's Prometheus metrics (``registry``, ``exposition()``) once started."""
        return self._seen.metrics

    @property
    def http_address(self) -> tuple[str, int] | None:
        """The (host, port) the health and metrics server listens on while running."""
        return self._seen.http.address if self._seen.http is not None else None

    @property
    def failure(self) -> ComponentFailedError | None:
        """The first component failure of the current (or last) run, if one happened."""
        return self._failure

    async def wait_failed(self) -> ComponentFailedError:
        """Wait, while the app runs, until one of its components fails for good; return that
        failure (``failure``). For hosts that run the app without ``serve`` and must learn
        of it (``eventflow.asgi.lifespan(app, on_failure=...)``)."""
        supervisor = self._supervisor
        if supervisor is None:
            raise ConfigurationError(
                f"app {self.name!r} is not running: call wait_failed after `await app.start()`"
            )
        return await supervisor.wait_failed()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the broker and store, join every subscription, start consumers. Idempotent.

        Bounded: each adapter fails its first connection within its connect timeout. The
        consumers, relays, projection runners and heartbeat then run as components of the
        app's supervisor: restarted after transient failures, and a component that cannot
        recover fails the app (``failure``; ``serve``/``run`` stop and raise it, ``async
        with app`` raises it on exit) without cancelling any task of the caller's.
        """
        async with self._lock:
            if self._started:
                return
            self._failure = None
            supervisor = self._supervisor = Supervisor(
                f"app {self.name}", self.restart_policy, on_failure=self._component_failed
            )
            try:
                if self._tracing_auto:
                    self._tracing = tracing_for(None, broker_url=self.broker.url)
                tracing = self._tracing
                if tracing is not None or self._saga_runtime.classes:
                    self.sagas.handling.tracing = tracing  # (made on first use otherwise)
                await self._seen.start(supervisor, self.http_host, self.http_port)
                await self.broker.start(supervisor)
                await self.store.open(supervisor)
                if self._dedup_override is not None:
                    await self._dedup_override.open()
                await self.limits.open(self.store)
                # Every subscription joins at once: on Kafka each join into a group is a
                # rebalance of about a second, so an app with a saga (a handler per event
                # type in one group) took that long per handler when they joined in turn.
                # A join that fails cancels the others; teardown closes the broker with them.
                guard = self._start_guard()
                consumers = [
                    Consumer(
                        self,
                        spec,
                        group,
                        signature,
                        grace_period=self.grace_period,
                        guard=guard,
                        tracing=tracing,
                    )
                    for spec, group, signature in self._bindings
                ]
                try:
                    async with asyncio.TaskGroup() as joining:
                        for consumer in consumers:
                            joining.create_task(consumer.subscribe())
                except BaseExceptionGroup as failed:  # the first join's own error, as before
                    raise failed.exceptions[0] from None
                self._consumers.extend(consumers)
                saga_classes = self._saga_runtime.classes
                if saga_classes:
                    declared(self.broker, Broker, "lag")  # overdue timers ask it
                    await self.sagas.persistence.setup()
                    self._saga_runtime.begin(self.broker)
                self._started = True
                self._seen.attach(supervisor, consumers)
                for consumer in self._consumers:
                    self._draining.append(
                        supervisor.spawn(f"consumer {consumer.name}", consumer.run)
                    )
                for projection in self.projections:
                    runner = ProjectionRunner(
                        projection, self.store, registry=self.registry, tracing=tracing
                    )
                    self._projection_runners.append(runner)
                    supervisor.spawn(f"projection {projection.name}", runner.run)
                for saga_cls in saga_classes:
                    supervisor.spawn(
                        f"saga timers {saga_cls.definition.name}",
                        functools.partial(self._saga_runtime.run_timers, saga_cls),
                    )
                if self.limits.clustered:
                    supervisor.spawn("limit slot renewals", self.limits.renew)
                outbox = OutboxRelay(self.store, self.broker, tracing=tracing)
                self._relays.append(outbox)
                supervisor.spawn("outbox relay", outbox.run)
                if self.relay_events:
                    events = EventRelay(self.store, self.broker, tracing=tracing)
                    self._relays.append(events)
                    supervisor.spawn("event relay", events.run)
                hb = Heartbeater(
                    self.store.heartbeats,
                    self.name,
                    self.instance,
                    tuple(c.name for c in self._consumers),
                    self._totals,
                    self.heartbeat_interval,
                    health=self.health,
                )
                self._heartbeater = hb
                await hb.beat()
                supervisor.spawn("heartbeat", hb.run)
            except BaseException:
                await self._teardown()
                raise

    def _start_guard(self) -> StallGuard | None:
        """Start the watchdog thread, if anything needs it: the blocked-loop warning, or a
        handler with a ``hard_timeout``."""
        if self.loop_block_warning is None and not any(
            spec.hard_timeout is not None for spec, _, _ in self._bindings
        ):
            return None
        guard = self._guard = StallGuard(self.loop_block_warning, name=f"app {self.name}")
        guard.start()
        return guard

    def _component_failed(self, failure: ComponentFailedError) -> None:
        if self._failure is None:
            self._failure = failure

    def _totals(self) -> dict[str, int]:
        """The heartbeat's counters: the consumers' summed, and the event loop's blocks."""
        totals: dict[str, int] = {}
        for consumer in self._consumers:
            for k, v in consumer.stats.as_dict().items():
                totals[k] = totals.get(k, 0) + v
        if self._guard is not None:
            totals["loop_blocks"] = self._guard.blocks
        return totals

    async def stop(self) -> None:
        """Stop fetching, drain in-flight handlers (``grace_period``), close. Idempotent."""
        async with self._lock:
            if not self._started:
                return
            await self._teardown()

    async def _teardown(self) -> None:
        for consumer in self._consumers:
            consumer.stop()
        for runner in self._projection_runners:
            runner.stop()
        supervisor, self._supervisor = self._supervisor, None
        try:
            if self._draining:
                # Consumers drain within the grace period (then cancel their handlers); none
                # is restarted any more, and one waiting in its restart backoff ends now.
                for component in self._draining:
                    component.finish()
                waiters = [asyncio.ensure_future(c.wait()) for c in self._draining]
                try:
                    await asyncio.wait(waiters, timeout=self.grace_period + _DRAIN_MARGIN)
                finally:
                    for waiter in waiters:
                        waiter.cancel()
            if supervisor is not None:
                await supervisor.close()
        finally:
            self._requests.stopped()
            guard, self._guard = self._guard, None
            if guard is not None:
                guard.stop()
            self._started = False
            self._consumers = []
            self._draining = []
            self._projection_runners = []
            self._relays = []
            try:
                await self._leave_heartbeat(supervisor)
            finally:
                try:
                    await self.limits.close()
                    if self._dedup_override is not None:
                        await self._dedup_override.close()
                    await self.store.close()
                finally:
                    await self.broker.close()

    async def _leave_heartbeat(self, supervisor: Supervisor | None) -> None:
        """Remove this instance's heartbeat on a clean stop; after a component failure, leave
        a last one saying so (``eventflow status`` shows it until it is pruned)."""
        hb, self._heartbeater = self._heartbeater, None
        if hb is None:
            return
        try:
            if self._failure is not None and supervisor is not None:
                await hb.beat(supervisor.health())  # (the limits are closed by then)
            else:
                await self.store.heartbeats.remove(self.instance)
        except Exception as exc:  # the store is down: the record goes stale by itself
            _log.warning("could not update the heartbeat of %s on stop: %s", self.instance, exc)

    async def __aenter__(self) -> App:
        await self.start()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self.stop()
        if self._failure is not None and exc is None:
            raise self._failure

    async def serve(
        self, stop: asyncio.Event | None = None, *, handle_signals: bool = True
    ) -> None:
        """Run until ``stop`` is set or SIGINT/SIGTERM arrives, then shut down gracefully.

        A signal (or ``stop``) during start-up ends it at once: ``serve`` returns without
        having served. A component that cannot recover stops the app and raises its
        ``ComponentFailedError``. With ``handle_signals=False`` the caller owns the signals
        (several apps in one loop).
        """
        await serve_app(self, stop or asyncio.Event(), handle_signals=handle_signals)

    def run(self) -> None:
        """Block running the app until SIGINT/SIGTERM (then a graceful shutdown); raise
        ``ComponentFailedError`` if a component could not recover."""
        asyncio.run(self.serve())
