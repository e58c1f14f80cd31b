"""Running sagas in an app: their handlers and ``app.sagas``.

Each saga class gets one ``@subscribe``-style handler per event type it takes (its start,
replies, rejections, abort), all in the consumer group ``saga.<name>``, with the options
declared on the class (``concurrency=``, ``retry=``, ``timeout=``). A handling applies the
message (:meth:`~eventflow.sagas.handling.Handling.message`) inside ``ctx.transaction()``:
the transitions, the index, the timers, the commands (through the outbox) and the message's
dedup entry commit together. Saga code that raises fails the handling like a handler's.

Timers: :mod:`eventflow.sagas.timers` (one loop per saga class).
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from ..context import Context
from ..envelope import Envelope
from ..errors import ConfigurationError
from ..events import Event, EventRegistry
from ..ports import Broker, Store
from ..subscribe import HandlerSpec
from .control import STATUSES
from .definition import Saga
from .handling import Handling, build
from .machine import Machine, Outcome, Transition
from .persistence import IndexRow, Loaded, SagaStore
from .timers import DEFAULT_CATCH_UP_LIMIT, SagaTimers

__all__ = ["DEFAULT_CATCH_UP_LIMIT", "SagaRuntime", "Sagas"]

_S = TypeVar("_S", bound=Saga)


def _check_classes(classes: Iterable[object]) -> tuple[type[Saga], ...]:
    out: list[type[Saga]] = []
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, Saga) and "definition" in vars(cls)):
            raise ConfigurationError(
                f"sagas= takes Saga subclasses declared with name=, start=, key=; got {cls!r}"
            )
        out.append(cls)
    names = [c.definition.name for c in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigurationError(f"two sagas are named {', '.join(map(repr, dupes))}")
    return tuple(out)


class Sagas:
    """``app.sagas``: read sagas from the app's store, and act on them as a person would.

    A saga class need not be among the app's ``sagas=`` to be read. ``clock``: the time
    inputs are applied at (Unix seconds; the test kit passes its virtual clock); ``check``:
    called with each saga before it is saved (the test kit checks its state reloads).
    """

    def __init__(
        self,
        store: Store,
        registry: EventRegistry,
        source: str,
        *,
        clock: Callable[[], float] = time.time,
        check: Callable[[Saga], None] | None = None,
    ) -> None:
        self._store = store
        self._check = check
        self._registry = registry
        self._source = source
        self._clock = clock
        self._handling: Handling | None = None
        self.classes: tuple[type[Saga], ...] = ()
        """The saga classes the app runs (its ``sagas=``)."""
        self.committed: Callable[[str, list[float]], None] | None = None
        """Called after a person's input committed, with the saga's name and the delays of
        the timers it set (the app's timer loops: ``SagaTimers.committed``)."""

    @property
    def handling(self) -> Handling:
        """How inputs are applied to this store's sagas (made on first use)."""
        if self._handling is None:
            self._handling = Handling(
                SagaStore(self._store),
                self._registry,
                self._source,
                self._clock,
                check=self._check,
            )
        return self._handling

    @property
    def persistence(self) -> SagaStore:
        """The store's saga tables (made on first use)."""
        return self.handling.persistence

    @property
    def conflicts(self) -> int:
        """Handlings that found their saga changed by another and applied their input again."""
        return self.handling.conflicts

    @property
    def stray(self) -> int:
        """Messages that named no saga key (logged, acked)."""
        return self.handling.stray

    async def get(self, cls: type[_S], key: str) -> _S | None:
        """The saga of ``key`` with its ``status`` and ``history``, or None."""
        loaded = await self.persistence.load(cls.definition, key)
        if loaded is None:
            return None
        saga = build(cls, loaded)
        history = await self.persistence.history(cls.definition.stream_prefix + key)
        saga._meta["history"] = [Transition.from_dict(d) for d in history]
        return saga

    async def list(
        self, *, status: str | None = None, name: str | None = None, limit: int = 1000
    ) -> builtins.list[IndexRow]:
        """Sagas in the index (id, name, key, status, started, updated), newest first."""
        if status is not None and status not in STATUSES:
            raise ConfigurationError(f"status={status!r}: one of {', '.join(STATUSES)}")
        await self.persistence.setup()
        return await self.persistence.list(name=name, status=status, limit=limit)

    async def find(self, saga_id: str) -> IndexRow | None:
        """The index row (name, key, status, times) of ``saga-<name>-<key>``, or None."""
        await self.persistence.setup()
        return await self.persistence.find(saga_id)

    def saga_class(self, name: str) -> type[Saga] | None:
        """The class among the app's ``sagas=`` declared with ``name=name``, or None."""
        return next((c for c in self.classes if c.definition.name == name), None)

    async def history(self, saga_id: str) -> builtins.list[Transition]:
        """The transitions of the saga ``saga_id`` (``saga-<name>-<key>``), oldest first."""
        return [Transition.from_dict(d) for d in await self.persistence.history(saga_id)]

    async def retry(self, cls: type[Saga], key: str, *, by: str | None = None) -> Outcome:
        """Issue the failed step (or compensation) again under a new attempt."""
        return await self._act(cls, key, lambda m: m.retry(by, None))

    async def skip(self, cls: type[Saga], key: str, *, by: str | None = None) -> Outcome:
        """Record that a person handled the failed step by hand, and go on."""
        return await self._act(cls, key, lambda m: m.skip(by, None))

    async def abort(
        self, cls: type[Saga], key: str, *, by: str | None = None, reason: str = "aborted"
    ) -> Outcome:
        """Compensate what the saga has done (before its pivot)."""
        return await self._act(cls, key, lambda m: m.abort(reason, None, by))

    async def _act(
        self, cls: type[Saga], key: str, what: Callable[[Machine], Awaitable[Outcome]]
    ) -> Outcome:
        """Apply a person's input in a store transaction of its own; its commands go to
        the store's outbox."""
        definition = cls.definition
        handling = self.handling
        await self.persistence.setup()

        async def run(loaded: Loaded | None, now: float) -> Machine:
            if loaded is None:
                raise ConfigurationError(
                    f"no saga {definition.stream_prefix}{key}: check the id with "
                    "`eventflow sagas list`"
                )
            machine = Machine(build(cls, loaded), loaded.control, now)
            await what(machine)
            return machine

        committed: list[Callable[[], None]] = []
        async with self._store.transaction() as tx:
            machine = await handling.apply(
                tx, cls, key, run, cause=None, after_commit=committed.append, send=True
            )
            assert machine is not None  # run never declines
        for call in committed:
            call()
        if self.committed is not None:
            timers = machine.out.timers_set.values()
            self.committed(definition.name, [due - machine.now for due, _ in timers])
        machine.out.status = machine.control.status.value
        return machine.out


class SagaRuntime:
    """The handlers and timer loops of an app's sagas."""

    def __init__(
        self,
        classes: Iterable[object],
        sagas: Sagas,
        registry: EventRegistry,
        *,
        catch_up_limit: float = DEFAULT_CATCH_UP_LIMIT,
    ) -> None:
        self.classes = _check_classes(classes)
        self.sagas = sagas
        sagas.classes = self.classes
        self.registry = registry
        self.timers = SagaTimers(sagas, catch_up_limit=catch_up_limit)
        """The timer loops (:mod:`eventflow.sagas.timers`)."""
        sagas.committed = self.timers.committed

    # -- handlers ------------------------------------------------------------------------

    def handler_specs(self) -> list[HandlerSpec]:
        """One handler per (saga, event type it takes), in the group ``saga.<name>``."""
        specs: list[HandlerSpec] = []
        for cls in self.classes:
            for event_cls in cls.definition.input_types():
                specs.append(
                    HandlerSpec(
                        fn=self._handler(cls, event_cls),
                        pattern=event_cls.event_type,
                        group=cls.definition.group,
                        concurrency=cls.definition.concurrency,
                        retry=cls.definition.retry,
                        timeout=cls.definition.timeout,
                        dead_letter=True,
                        idempotent=True,
                        dedup_at_commit=True,  # all in its transaction, see _handle
                    )
                )
        return specs

    def begin(self, broker: Broker | None) -> None:
        """A run of the app starts: see :meth:`SagaTimers.begin`."""
        self.timers.begin(broker)

    async def run_timers(self, cls: type[Saga]) -> None:
        """Fire the due timers of ``cls`` forever: see :meth:`SagaTimers.run`."""
        await self.timers.run(cls)

    def _handler(self, cls: type[Saga], event_cls: type[Event]) -> Callable[..., Any]:
        definition = cls.definition
        runtime = self

        async def handle(envelope: Envelope, ctx: Context) -> None:
            event = runtime.registry.decode_as(envelope, event_cls)
            await runtime._handle(cls, event, envelope, ctx)

        handle.__name__ = handle.__qualname__ = f"saga_{definition.name}_{event_cls.event_type}"
        handle.__module__ = cls.__module__
        return handle

    async def _handle(self, cls: type[Saga], event: Event, env: Envelope, ctx: Context) -> None:
        handling = self.sagas.handling
        # No effect outside the transaction: the commands go to the outbox with the saga's
        # save (on PostgreSQL in its append's statement), wake-ups after its commit; so a
        # duplicate rolls back whole at its dedup entry (``dedup_at_commit``), which rides
        # on the save where the store can (PostgreSQL: in the append's statement). A stream
        # found moved at the commit (SQLite checks the version there) is applied again by
        # the pipeline, in a fresh transaction.
        async with ctx.transaction() as tx:
            machine = await handling.message(
                tx,
                cls,
                event,
                env,
                after_commit=ctx._after_commit,
                send=True,
                group=ctx.group,
                checked_at_commit=True,
            )
        if machine is None:
            self.timers.after_handling(ctx, cls.definition, {}, 0.0)
            return
        self.timers.after_handling(ctx, cls.definition, machine.out.timers_set, machine.now)
