"""``App``: wires handlers to a broker and a store, and owns every task it starts.

Lifecycle: ``async with app`` (or ``app.run()``) starts the broker and store, joins every
subscription (and returns only once they are all live), then runs the consumers and the
heartbeat in one ``asyncio.TaskGroup``. Leaving stops fetching, drains in-flight handlers
within ``grace_period`` and closes the subscriptions so unacked messages are redelivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from . import events as _events
from .brokers import open_broker
from .envelope import Envelope, _encode_fields, _trusted_envelope, new_id
from .errors import BrokerError, ConfigurationError
from .events import (
    Event,
    EventRegistry,
    _envelope_fields,
    _is_event,
    default_registry,
    to_envelope,
)
from .patterns import overlap, validate_topic
from .ports import Broker, DedupStore, Store
from .projections import Projection, ProjectionRunner
from .runtime.consumer import Consumer
from .runtime.deadletters import DeadLetters
from .runtime.heartbeat import DEFAULT_HEARTBEAT_INTERVAL, Heartbeater
from .runtime.relay import EventRelay, OutboxRelay, _id_headers
from .schema.outgoing import check_outgoing
from .sourcing.aggregate import Aggregate
from .sourcing.repository import Repository
from .stores import dedup_for, store_for
from .subscribe import HandlerSpec, check_reachable, collect_handlers, inspect_handler

__all__ = ["DEFAULT_GRACE_PERIOD", "MESSAGE_ID_HEADER", "App"]

DEFAULT_GRACE_PERIOD = 10.0
MESSAGE_ID_HEADER = "eventflow-id"
"""Broker header carrying the envelope id (brokers use it for server-side dedup); not sent
to a broker whose class sets ``wants_message_id = False`` (see :class:`~eventflow.ports.Broker`)."""
_log = logging.getLogger("eventflow.app")
_A = TypeVar("_A", bound=Aggregate)


class App:
    """An event-driven service: a name, a broker, a store and its handlers.

    ``broker`` and ``store`` take a URL or an adapter instance. ``dedup`` defaults to the
    store's dedup table (or a ``DedupStore`` / ``redis://host:6379/0`` URL). ``handlers``
    lists ``@subscribe`` functions or modules of them.
    ``projections`` lists ``Projection`` instances, each run by one instance at a time
    across processes. The app relays the store's outbox (messages published inside
    ``ctx.transaction()``) to the broker; with ``relay_events=True`` it also publishes every
    event appended to the store (topic = type, key = stream id), in order per stream.
    """

    def __init__(
        self,
        name: str,
        *,
        broker: str | Broker = "memory://",
        store: str | Store = "memory://",
        handlers: Iterable[object] = (),
        projections: Iterable[Projection] = (),
        relay_events: bool = False,
        dedup: str | DedupStore | None = None,
        registry: EventRegistry | None = None,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    ) -> None:
        if not name or any(c in name for c in " \t\n"):
            raise ConfigurationError(f"app name {name!r} must be non-empty without spaces")
        self.name = name
        self.broker: Broker = open_broker(broker)
        self._id_header = (
            MESSAGE_ID_HEADER if getattr(self.broker, "wants_message_id", True) else None
        )
        self.store: Store = store_for(store)
        self.registry = registry or default_registry
        self.grace_period = grace_period
        self.heartbeat_interval = heartbeat_interval
        self.instance = f"{name}@{socket.gethostname()}:{os.getpid()}:{new_id()[-12:]}"
        self._dedup_override = dedup_for(dedup) if dedup is not None else None
        self._specs = collect_handlers(handlers)
        self._bindings = [
            (spec, spec.group or name, inspect_handler(spec.fn)) for spec in self._specs
        ]
        check_reachable((spec, signature) for spec, _, signature in self._bindings)
        self._check_groups()
        self.projections: tuple[Projection, ...] = tuple(projections)
        for p in self.projections:
            if not isinstance(p, Projection):
                raise ConfigurationError(
                    f"projections= takes Projection instances, got {p!r}: pass StockLevels()"
                )
        names = [p.name for p in self.projections]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigurationError(
                f"two projections are named {', '.join(map(repr, dupes))}; names identify "
                "checkpoints, give each projection its own name="
            )
        self.relay_events = relay_events
        self._projection_runners: list[ProjectionRunner] = []
        self._relays: list[OutboxRelay | EventRelay] = []
        self._background: list[asyncio.Task[None]] = []
        self._consumers: list[Consumer] = []
        self._tg: asyncio.TaskGroup | None = None
        self._heartbeater: Heartbeater | None = None
        self._started = False
        self._lock = asyncio.Lock()

    def _check_groups(self) -> None:
        seen: list[tuple[str, HandlerSpec]] = []
        for spec, group, _ in self._bindings:
            for other_group, other in seen:
                if group == other_group and overlap(spec.pattern, other.pattern):
                    raise ConfigurationError(
                        f"handlers {other.name} ({other.pattern!r}) and {spec.name} "
                        f"({spec.pattern!r}) are in the same group {group!r} with overlapping "
                        "patterns, so one would take the other's messages; give one of them "
                        "its own group="
                    )
            seen.append((group, spec))

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
    def dead_letters(self) -> DeadLetters:
        """The dead letters of this app's groups: ``list``, ``get``, ``replay``, ``purge``."""
        return DeadLetters(self.store.dead_letters, self.broker, self.groups or None)

    def repository(
        self,
        cls: type[_A],
        *,
        snapshot_every: int | None = None,
        stream_prefix: str | None = None,
    ) -> Repository[_A]:
        """A ``Repository`` of ``cls`` aggregates in this app's store; the events it saves
        carry the app's name as their source. Use it once the app is started (the store
        is open): inside ``async with app`` or a handler."""
        return Repository(
            cls,
            self.store,
            snapshot_every=snapshot_every,
            stream_prefix=stream_prefix,
            source=self.name,
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
        """Counters per consumer (``group:pattern``): received, handled, duplicates, ..."""
        return {c.name: c.stats.as_dict() for c in self._consumers}

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
        """
        if _is_event(message):
            fields = _envelope_fields(
                message,
                self.name,
                key,
                headers,  # copied there
                correlation_id,
                None,
                None,
                None,
            )
            if _events.unvalidated_made:  # model_construct/model_copy skip validation
                check_outgoing(message, fields["data"])
            env = _trusted_envelope(fields)
            payload = _encode_fields(fields)  # env.to_bytes(): fields is its __dict__
        else:
            # An Envelope keeps its id; to_envelope rejects anything that is neither.
            env = _override(to_envelope(message, source=self.name), key, headers, correlation_id)
            fields = env.__dict__
            payload = env.to_bytes()  # a subclass may encode itself differently
        if topic is None:
            topic = fields["type"]
        else:
            validate_topic(topic)
        if not self._started:
            self._not_running()
        await self.broker.publish(
            topic,
            payload,
            key=fields["key"],
            headers=_id_headers(self._id_header, fields["id"]),
        )
        return env

    def _not_running(self) -> None:
        raise BrokerError(
            f"app {self.name!r} is not running: publish inside `async with app:` "
            "or after `await app.start()`"
        )

    async def _send(self, topic: str, env: Envelope) -> None:
        if not self._started:
            self._not_running()
        await self.broker.publish(
            topic, env.to_bytes(), key=env.key, headers=_id_headers(self._id_header, env.id)
        )

    async def _send_all(self, outbox: list[tuple[str, Envelope]]) -> None:
        """Send what a handler published; retry with backoff until sent (ids are fixed)."""
        delay = 0.05
        for topic, env in outbox:
            while True:
                try:
                    await self._send(topic, env)
                    break
                except ConfigurationError:
                    raise
                except Exception as exc:
                    _log.warning("publishing %s to %s failed (%s); retrying", env.id, topic, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the broker and store, join every subscription, start consumers. Idempotent."""
        async with self._lock:
            if self._started:
                return
            await self.broker.start()
            try:
                await self.store.open()
                tg = asyncio.TaskGroup()
                await tg.__aenter__()
                self._tg = tg
                for spec, group, signature in self._bindings:
                    consumer = Consumer(
                        self,
                        spec,
                        group,
                        signature,
                        self.registry,
                        self.dedup,
                        self.store.dead_letters,
                        grace_period=self.grace_period,
                    )
                    await consumer.subscribe()
                    self._consumers.append(consumer)
                self._started = True
                for consumer in self._consumers:
                    tg.create_task(consumer.run(), name=f"eventflow:{consumer.name}")
                for projection in self.projections:
                    runner = ProjectionRunner(projection, self.store, registry=self.registry)
                    self._projection_runners.append(runner)
                    tg.create_task(runner.run(), name=f"eventflow:projection:{projection.name}")
                self._relays.append(OutboxRelay(self.store, self.broker, self._id_header))
                if self.relay_events:
                    self._relays.append(EventRelay(self.store, self.broker, self._id_header))
                for relay in self._relays:
                    self._background.append(
                        tg.create_task(relay.run(), name=f"eventflow:{type(relay).__name__}")
                    )
                hb = Heartbeater(
                    self.store.heartbeats,
                    self.name,
                    self.instance,
                    tuple(c.name for c in self._consumers),
                    self._totals,
                    self.heartbeat_interval,
                )
                self._heartbeater = hb
                await hb.beat()
                self._hb_task = tg.create_task(hb.run(), name="eventflow:heartbeat")
            except BaseException:
                await self._teardown()
                raise

    def _totals(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for consumer in self._consumers:
            for k, v in consumer.stats.as_dict().items():
                totals[k] = totals.get(k, 0) + v
        return totals

    async def stop(self) -> None:
        """Stop fetching, drain in-flight handlers (``grace_period``), close. Idempotent."""
        async with self._lock:
            if not self._started:
                return
            await self._teardown()

    async def _teardown(self, exc: BaseException | None = None) -> None:
        for consumer in self._consumers:
            consumer.stop()
        for runner in self._projection_runners:
            runner.stop()
        for task in self._background:
            task.cancel()
        hb_task = getattr(self, "_hb_task", None)
        if hb_task is not None:
            hb_task.cancel()
        tg, self._tg = self._tg, None
        try:
            if tg is not None:
                await tg.__aexit__(
                    type(exc) if exc else None, exc, exc.__traceback__ if exc else None
                )
        finally:
            self._started = False
            self._consumers = []
            self._projection_runners = []
            self._relays = []
            self._background = []
            if self._heartbeater is not None:
                with contextlib.suppress(Exception):
                    await self.store.heartbeats.remove(self.instance)
                self._heartbeater = None
            if self._dedup_override is not None:
                await self._dedup_override.close()
            await self.store.close()
            await self.broker.close()

    async def __aenter__(self) -> App:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.stop()

    async def serve(
        self, stop: asyncio.Event | None = None, *, handle_signals: bool = True
    ) -> None:
        """Run until ``stop`` is set or SIGINT/SIGTERM arrives, then shut down gracefully.

        With ``handle_signals=False`` the caller owns the signals (several apps in one loop).
        """
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        for sig in (signal.SIGINT, signal.SIGTERM) if handle_signals else ():
            try:
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread or no signal support: rely on `stop`
        try:
            async with self:
                _log.info("app %s running (%d subscriptions)", self.name, len(self._consumers))
                await stop.wait()
                _log.info("app %s stopping", self.name)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    def run(self) -> None:
        """Block running the app until SIGINT/SIGTERM (then a graceful shutdown)."""
        asyncio.run(self.serve())


def _override(
    env: Envelope,
    key: str | None,
    headers: Mapping[str, str] | None,
    correlation_id: str | None,
) -> Envelope:
    """``env`` with the fields given to ``publish`` replaced (the id stays)."""
    update: dict[str, Any] = {}
    if key is not None:
        update["key"] = key
    if headers:
        update["headers"] = {**env.headers, **headers}
    if correlation_id is not None:
        update["correlation_id"] = correlation_id
    return env.model_copy(update=update) if update else env
