"""``Projection``: a read model built from the event store by ``@on`` handlers.

::

    class StockLevels(Projection, name="stock_levels"):
        async def setup(self, tx: Transaction) -> None:       # before the first event
            await tx.execute("CREATE TABLE IF NOT EXISTS stock_levels (sku TEXT, qty INT)")

        async def reset(self, tx: Transaction) -> None:
            await tx.execute("DELETE FROM stock_levels")      # rebuild starts from empty

        @on(StockReserved)
        async def _reserved(self, e: StockReserved, ctx: ProjectionContext) -> None:
            await ctx.transaction().execute(
                "UPDATE stock_levels SET qty = qty - $1 WHERE sku = $2", e.qty, e.sku
            )

A handler is ``async def handler(self, event, ctx)``; events of types without a handler are
skipped (their position still advances the checkpoint). ``ctx.transaction()`` is the
transaction the runner commits the projection's checkpoint in, so the projection's writes and
its position commit together or not at all.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigurationError, EventflowError
from ..events import Event
from ..ports import RecordedEvent, Store, Transaction
from ..sourcing.on import appliers

__all__ = [
    "Handler",
    "Projection",
    "ProjectionContext",
    "ProjectionError",
    "ProjectionHandlerError",
    "ProjectionLockedError",
    "ProjectionStatus",
    "lease_name",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")

Handler = Callable[[Event, "ProjectionContext"], Awaitable[None]]
"""A bound ``@on`` method of a projection: ``await handler(event, ctx)``."""


class ProjectionError(EventflowError):
    """A projection could not be run, reset or rebuilt (the message says what to do)."""


class ProjectionLockedError(ProjectionError):
    """Another instance holds the projection's lease: it is running in an app somewhere."""


class ProjectionHandlerError(ProjectionError):
    """A projection handler raised (or its event could not be decoded); the batch rolled back.

    ``position``, ``stream_id`` and ``event_type`` name the event; ``__cause__`` is the error.
    """

    def __init__(self, projection: str, record: RecordedEvent, cause: BaseException) -> None:
        super().__init__(
            f"projection {projection!r} failed on event @{record.position} "
            f"({record.envelope.type!r} in stream {record.stream_id!r}): "
            f"{type(cause).__name__}: {cause}; fix the handler (or the event's upcaster) and "
            "restart: the projection resumes from this event"
        )
        self.projection = projection
        self.position = record.position
        self.stream_id = record.stream_id
        self.event_type = record.envelope.type


@dataclass(frozen=True, slots=True)
class ProjectionStatus:
    """Where a projection stands: its checkpoint against the store's newest position."""

    name: str
    checkpoint: int
    last_position: int
    running: bool | None = None
    """True/False when known (this runner, or the store's lease record), None when not
    checked (or the store did not answer in time)."""

    @property
    def lag(self) -> int:
        """Events appended to the store that the projection has not handled yet."""
        return max(0, self.last_position - self.checkpoint)


def lease_name(projection_name: str) -> str:
    """The store lease that keeps one instance of a projection running at a time."""
    return f"projection:{projection_name}"


class ProjectionContext:
    """What a projection handler gets besides the event.

    ``record`` is the stored event (stream, version, position, envelope); ``transaction()``
    returns the store transaction of the current batch, the one the checkpoint commits in.
    """

    __slots__ = ("_tx", "projection", "record", "store")

    def __init__(self, store: Store, projection: Projection, tx: Transaction) -> None:
        self.store = store
        self.projection = projection
        self._tx = tx
        self.record: RecordedEvent | None = None

    @property
    def position(self) -> int:
        """The global position of the event being handled."""
        if self.record is None:
            raise ProjectionError("ctx.position is only available inside a handler")
        return self.record.position

    def transaction(self) -> _BatchTransaction:
        """The current batch's transaction: write the projection's tables through it, as
        ``async with ctx.transaction() as tx:`` (like a handler's ``ctx.transaction()``) or
        directly (``await ctx.transaction().execute(...)``).

        On SQL stores it commits with the projection's checkpoint; on the ``memory://``
        store it has no SQL, so keep the projection's state in its own attributes.
        """
        return _BatchTransaction(self._tx)


class _BatchTransaction:
    """The batch's transaction, usable directly or as an async context manager (the batch
    commits or rolls back as a whole after its handlers, not when the block exits)."""

    __slots__ = ("_tx",)

    def __init__(self, tx: Transaction) -> None:
        self._tx = tx

    async def execute(self, sql: str, *args: Any) -> Any:
        """Run one statement in the batch's transaction."""
        return await self._tx.execute(sql, *args)

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Run a query in the batch's transaction."""
        return await self._tx.fetch(sql, *args)

    def __getattr__(self, name: str) -> Any:
        # Adapter-specific extras of the store's transaction (e.g. the memory store's
        # ``defer``) stay reachable.
        return getattr(self._tx, name)

    async def __aenter__(self) -> Transaction:
        return self._tx

    async def __aexit__(self, *exc: object) -> None:
        return None


class Projection:
    """Base class of projections: subclass with a ``name`` and ``@on`` handlers.

    ``class StockLevels(Projection, name="stock_levels")``. The name identifies the
    projection's checkpoint and lease in the store, so keep it stable across deployments.
    Override ``setup`` to create the projection's tables, and ``reset`` to drop its state
    before a rebuild.
    """

    name: ClassVar[str] = ""
    _handler_names: ClassVar[dict[str, tuple[type[Event], str]]] = {}

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            if not isinstance(name, str) or not _NAME.match(name):
                raise ConfigurationError(
                    f"{cls.__qualname__}: projection name {name!r} must be letters, digits, "
                    "'_', '.' or '-' (it names the projection's checkpoint)"
                )
            cls.name = name
        found = appliers(cls)
        for event_type, (_, method) in found.items():
            fn = getattr(cls, method)
            if not inspect.iscoroutinefunction(fn):
                raise ConfigurationError(
                    f"{cls.__qualname__}.{method} handles {event_type!r} but is not "
                    "`async def`; projection handlers are `async def h(self, event, ctx)`"
                )
        cls._handler_names = found

    @classmethod
    def handled_types(cls) -> tuple[str, ...]:
        """The event types this projection has handlers for, sorted."""
        return tuple(sorted(cls._handler_names))

    def handlers(self) -> dict[str, tuple[type[Event], Handler]]:
        """Event type -> (event class, bound handler) for this instance."""
        if not self.name:
            raise ConfigurationError(
                f"{type(self).__qualname__} has no name: declare it as "
                f"`class {type(self).__name__}(Projection, name='...')`"
            )
        return {
            event_type: (event_cls, getattr(self, method))
            for event_type, (event_cls, method) in self._handler_names.items()
        }

    async def setup(self, tx: Transaction) -> None:
        """Prepare the projection's storage (``CREATE TABLE IF NOT EXISTS ...``); the default
        does nothing.

        Called in a transaction of its own each time a runner becomes the active instance
        (before it reads its checkpoint and follows the log) and at the start of a rebuild
        (before ``reset``). It runs again whenever a runner takes over, after a restart or a
        lost lease, so make it idempotent.
        """

    async def reset(self, tx: Transaction) -> None:
        """Drop the projection's state; ``rebuild`` calls it before replaying the log.

        Runs in the same transaction that deletes the checkpoint. Override it: truncate the
        projection's tables through ``tx`` on SQL stores, or clear the attributes that hold
        the state on ``memory://``. The default refuses, because replaying onto old state
        would count every event twice.
        """
        raise ProjectionError(
            f"projection {self.name!r} ({type(self).__qualname__}) cannot be rebuilt: it does "
            "not override `async def reset(self, tx)`; define it to delete the projection's "
            "state (e.g. `await tx.execute('DELETE FROM my_table')`, or clear its attributes "
            "on memory://)"
        )

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} projection {self.name!r}>"
