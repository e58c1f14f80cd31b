"""``Repository``: loads aggregates from their streams and saves their new events.

::

    repo = Repository(Order, store, snapshot_every=100)
    order = await repo.load("o-1")                 # AggregateNotFound if there is no stream
    order.place("sku-1")
    await repo.save(order)                         # ConcurrencyError if someone saved first

    # a command handler: load, decide, save; reload and run again on a conflict
    await repo.update("o-1", lambda order: order.place("sku-1"))

Streams are named ``f"{prefix}-{id}"``; the prefix is the class's ``stream=`` keyword
(default: its name in snake_case) unless ``stream_prefix=`` overrides it. Saving appends
the pending events with ``expected_version`` = the version the aggregate was loaded at,
so two writers of one aggregate never both succeed from the same state.

Snapshots (``snapshot_every=N``): after a save that takes the stream across a multiple of N,
the state is stored as a snapshot; ``load`` starts from the latest valid snapshot and replays
only the events after it. Without ``snapshot_every`` snapshots are neither read nor written.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from ..envelope import Envelope, new_id
from ..errors import AggregateNotFound, ConcurrencyError, ConfigurationError
from ..events import Event, EventRegistry, default_registry, to_envelope
from ..headers import TRACEPARENT_HEADER
from ..ports import EventStore
from .aggregate import Aggregate
from .snapshots import restore_snapshot, take_snapshot

__all__ = ["DEFAULT_UPDATE_ATTEMPTS", "Repository"]

DEFAULT_UPDATE_ATTEMPTS = 3
_log = logging.getLogger("eventflow.sourcing")

A = TypeVar("A", bound=Aggregate)


class Repository(Generic[A]):
    """Loads and saves aggregates of one class in an event store.

    ``snapshot_every``: store a snapshot each time the stream crosses a multiple of this
    many events (None: no snapshots). ``stream_prefix`` overrides the class's ``stream=``.
    ``source`` is written in the saved events' envelopes (``App.repository`` passes the
    app's name). ``registry`` decodes and upcasts the stored events on load (the default
    registry when None; ``App.repository`` passes the app's).
    """

    def __init__(
        self,
        cls: type[A],
        store: EventStore,
        *,
        snapshot_every: int | None = None,
        stream_prefix: str | None = None,
        source: str = "",
        registry: EventRegistry | None = None,
    ) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Aggregate)) or cls is Aggregate:
            raise ConfigurationError(
                f"Repository takes an Aggregate subclass, got {cls!r}: "
                "declare class Order(Aggregate): ..."
            )
        if snapshot_every is not None and (
            not isinstance(snapshot_every, int) or snapshot_every < 1
        ):
            raise ConfigurationError(
                f"snapshot_every must be a positive int (events between snapshots) or None, "
                f"got {snapshot_every!r}"
            )
        prefix = cls.aggregate_stream if stream_prefix is None else stream_prefix
        if not prefix or "-" in prefix or any(c.isspace() for c in prefix):
            raise ConfigurationError(
                f"stream_prefix {prefix!r} must be non-empty, without '-' or spaces"
            )
        self.cls = cls
        self.store = store
        self.snapshot_every = snapshot_every
        self.stream_prefix = prefix
        self.source = source
        self.registry: EventRegistry = default_registry if registry is None else registry

    def stream_id(self, aggregate_id: str) -> str:
        """The stream holding the events of ``aggregate_id``: ``f"{prefix}-{id}"``."""
        if not isinstance(aggregate_id, str) or not aggregate_id:
            raise ConfigurationError(
                f"an aggregate id must be a non-empty str, got {aggregate_id!r}"
            )
        return f"{self.stream_prefix}-{aggregate_id}"

    async def load(self, aggregate_id: str) -> A:
        """The aggregate rebuilt from its latest snapshot (if any) and the events after it.

        Raises ``AggregateNotFound`` if its stream has no events (and no snapshot).
        """
        aggregate = await self._load(aggregate_id)
        if aggregate is None:
            name = self.cls.__qualname__
            raise AggregateNotFound(
                f"no {name} with id {aggregate_id!r}: stream {self.stream_id(aggregate_id)!r} "
                f"has no events; create it with repo.create({name}(id=...)) or use "
                "repo.get_or_create(id)"
            )
        return aggregate

    async def get_or_create(self, aggregate_id: str) -> A:
        """The stored aggregate, or a new one (version 0) built with ``cls(id=aggregate_id)``
        if its stream does not exist; the new one is stored by the first ``save``."""
        aggregate = await self._load(aggregate_id)
        return self.cls(id=aggregate_id) if aggregate is None else aggregate

    async def exists(self, aggregate_id: str) -> bool:
        """True if the aggregate's stream has events."""
        return await self.store.stream_version(self.stream_id(aggregate_id)) > 0

    async def save(self, aggregate: A, *, caused_by: Envelope | None = None) -> int:
        """Append the aggregate's pending events; return the stream's new version.

        The append expects the stream at ``aggregate.saved_version`` (the loaded version) and
        raises ``ConcurrencyError`` if another writer got there first: reload and retry, or
        use ``update``. Saving an aggregate with nothing pending does nothing. ``caused_by``
        (a handler's ``ctx.envelope``) puts the events in its correlation, caused by it.
        """
        if not isinstance(aggregate, self.cls):
            raise ConfigurationError(
                f"this repository saves {self.cls.__qualname__} aggregates, got "
                f"{type(aggregate).__qualname__}"
            )
        pending = aggregate.pending
        if not pending:
            return aggregate.version
        expected = aggregate.saved_version
        stream_id = self.stream_id(aggregate.id)
        envelopes = self._envelopes(stream_id, pending, caused_by)
        version = await self.store.append(stream_id, envelopes, expected_version=expected)
        aggregate._saved(version)
        every = self.snapshot_every
        if every is not None and expected // every != version // every:
            await self._snapshot(stream_id, aggregate)
        return version

    async def create(self, aggregate: A, *, caused_by: Envelope | None = None) -> int:
        """Save a new aggregate (version 0 plus its recorded events); return its version.

        Raises ``ConcurrencyError`` if a stream with its id already exists.
        """
        if aggregate.saved_version != 0:
            raise ConfigurationError(
                f"create() takes a new aggregate, but {aggregate.id!r} was loaded at version "
                f"{aggregate.saved_version}; use save()"
            )
        if not aggregate.pending:
            raise ConfigurationError(
                f"create() needs at least one recorded event: a stream with no events does "
                f"not exist; record one on {aggregate.id!r} first"
            )
        return await self.save(aggregate, caused_by=caused_by)

    async def update(
        self,
        aggregate_id: str,
        command: Callable[[A], object | Awaitable[object]],
        *,
        attempts: int = DEFAULT_UPDATE_ATTEMPTS,
        create: bool = False,
        caused_by: Envelope | None = None,
    ) -> A:
        """Load, run ``command(aggregate)`` (sync or async), save; return the saved aggregate.

        On ``ConcurrencyError`` the aggregate is reloaded and ``command`` runs again on the
        new state, at most ``attempts`` times in all (then the last ``ConcurrencyError`` is
        raised), so ``command`` must only decide and record events: no other side effects.
        An exception from ``command`` propagates and nothing is saved. With ``create=True`` a
        missing aggregate starts new (``get_or_create``) instead of raising
        ``AggregateNotFound``.
        """
        if not isinstance(attempts, int) or attempts < 1:
            raise ConfigurationError(f"attempts must be an int >= 1, got {attempts!r}")
        for attempt in range(1, attempts + 1):
            if create:
                aggregate = await self.get_or_create(aggregate_id)
            else:
                aggregate = await self.load(aggregate_id)
            result = command(aggregate)
            if inspect.isawaitable(result):
                await result
            try:
                await self.save(aggregate, caused_by=caused_by)
            except ConcurrencyError as exc:
                if attempt == attempts:
                    raise
                _log.debug("update of %s conflicted (%s); retrying", exc.stream, exc)
                continue
            return aggregate
        raise AssertionError("unreachable")  # pragma: no cover

    async def _load(self, aggregate_id: str) -> A | None:
        stream_id = self.stream_id(aggregate_id)
        aggregate: A | None = None
        if self.snapshot_every is not None:
            snapshot = await self.store.load_snapshot(stream_id)
            if snapshot is not None:
                aggregate = restore_snapshot(self.cls, aggregate_id, snapshot)
        if aggregate is None:
            aggregate = self.cls(id=aggregate_id)
        registry = self.registry
        async for rec in self.store.read_stream(stream_id, from_version=aggregate.version + 1):
            aggregate._replay(rec, registry)
        return aggregate if aggregate.version > 0 else None

    def _envelopes(
        self, stream_id: str, events: tuple[Event, ...], caused_by: Envelope | None
    ) -> list[Envelope]:
        # One command's events share a correlation: the cause's, else the first event's id.
        first = new_id()
        if caused_by is not None:
            correlation, causation = caused_by.correlation_id or caused_by.id, caused_by.id
            parent = caused_by.headers.get(TRACEPARENT_HEADER)
        else:
            correlation, causation, parent = first, None, None
        return [
            to_envelope(
                event,
                source=self.source,
                key=stream_id,
                correlation_id=correlation,
                causation_id=causation,
                parent_traceparent=parent,
                id=first if i == 0 else None,
            )
            for i, event in enumerate(events)
        ]

    async def _snapshot(self, stream_id: str, aggregate: A) -> None:
        # The events are committed: a failed snapshot only makes later loads slower, and
        # raising here would make the caller retry a command that already succeeded.
        try:
            await self.store.save_snapshot(take_snapshot(stream_id, aggregate))
        except Exception:
            _log.warning(
                "could not store the snapshot of %s at v%d; loads replay more events until "
                "the next one",
                stream_id,
                aggregate.version,
                exc_info=True,
            )
