"""Running sagas in an app: their handlers, their timer loop, and ``app.sagas``.

Each saga class gets one ``@subscribe``-style handler per event type it takes (its start,
replies, rejections, abort), all in the consumer group ``saga.<name>``, with the options
declared on the class (``concurrency=``, ``retry=``, ``timeout=``). A handling applies the
message (:meth:`~eventflow.sagas.handling.Handling.message`) inside ``ctx.transaction()``:
the transitions, the index, the timers, the commands (through the outbox) and the message's
dedup entry commit together. Saga code that raises fails the handling like a handler's.

Timers: one loop per saga class, holding the store lease ``eventflow:saga-timers:<name>``
(one instance at a time across processes), fires due timers, each in a store transaction
fenced by that lease. A timer that came due while no instance ran waits, when the app
starts, until the broker has nothing left for the saga's group (``Broker.backlog`` is 0 on
each of its patterns: nothing undelivered, nothing delivered and not acked, also what a
killed member still holds), at most ``catch_up_limit`` seconds: a reply that reached the
broker before the deadline wins over the timeout. A broker that cannot tell its backlog
(None) leaves the older rule: each saga consumer had a fetch that found nothing left.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .._logging import Throttled
from ..context import Context
from ..envelope import Envelope
from ..errors import BrokerError, ConfigurationError
from ..events import Event, EventRegistry
from ..ports import Store
from ..subscribe import HandlerSpec
from .control import STATUSES
from .definition import Saga, SagaDefinition
from .handling import Handling, build
from .machine import Machine, Outcome, Transition
from .persistence import IndexRow, Loaded, SagaStore, TimerRow

if TYPE_CHECKING:
    from ..leases import Lease

__all__ = ["SagaRuntime", "Sagas"]

_log = logging.getLogger("eventflow.sagas")
_warn = Throttled(_log)
_S = TypeVar("_S", bound=Saga)
_TIMER_POLL = 0.5
_BACKLOG_CACHE = 0.2
DEFAULT_CATCH_UP_LIMIT = 30.0


class CaughtUp(Protocol):
    """What the timer loop asks of a consumer (``runtime.consumer.Consumer``)."""

    @property
    def group(self) -> str:
        """The consumer group."""

    @property
    def caught_up_at(self) -> float:
        """When a fetch last found nothing left (wall time; 0.0: not yet)."""

    async def backlog(self) -> int | None:
        """What the group still has to handle on the consumer's pattern (None: unknown)."""


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

        async with self._store.transaction() as tx:
            machine = await handling.apply(tx, cls, key, run, cause=None)
            assert machine is not None  # run never declines
            await self._store.outbox.add(handling.sends(definition, machine, None), tx=tx)
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
        self.catch_up_limit = catch_up_limit
        self._started_at = 0.0
        self._wake = asyncio.Event()
        self._caught_up: dict[str, builtins.list[CaughtUp]] = {}
        self._backlogs: dict[str, tuple[float, int | None]] = {}  # group -> (at, sum)

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
                    )
                )
        return specs

    def begin(self, consumers: Iterable[CaughtUp]) -> None:
        """A run of the app starts (every start, also of an App stopped before): timers due
        before now wait for this run's saga consumers to catch up, not the last run's."""
        self._started_at = time.time()
        self._caught_up = {}
        for consumer in consumers:
            self.watch_consumer(consumer)

    def watch_consumer(self, consumer: CaughtUp) -> None:
        """Let the timer loop ask a consumer of the app when it last had nothing left (only
        the saga groups' consumers count)."""
        if consumer.group.startswith("saga."):
            self._caught_up.setdefault(consumer.group, []).append(consumer)

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
        async with ctx.transaction() as tx:
            machine = await handling.message(tx, cls, event, env)
        if machine is None:
            return
        for topic, command in handling.sends(cls.definition, machine, env):
            await ctx.publish(command, topic=topic)
        # The timer loop looks at least every _TIMER_POLL seconds: wake it only for a timer
        # due before its next look (waking it for every step's timeout cost two queries).
        timers = machine.out.timers_set
        if timers and min(due for due, _ in timers.values()) < time.time() + _TIMER_POLL:
            self._wake.set()

    # -- timers --------------------------------------------------------------------------

    async def run_timers(self, cls: type[Saga]) -> None:
        """Fire the due timers of ``cls`` forever, holding its timer lease."""
        definition = cls.definition
        store = self.sagas.persistence
        await store.setup()
        if not self._started_at:  # run without begin(): this is the start
            self._started_at = time.time()
        names = [definition.name]
        async with store.store.leases.hold(_timer_lease(definition)) as lease:
            while True:
                self._wake.clear()
                now = time.time()
                for row in await store.due(names, now):
                    if not await self._may_fire(definition, row, now):
                        continue
                    await self._fire(cls, row, lease)
                nxt = await store.next_due(names)
                wait = _TIMER_POLL if nxt is None else min(_TIMER_POLL, max(0.0, nxt - time.time()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=max(wait, 0.005))

    async def _may_fire(self, definition: SagaDefinition, row: TimerRow, now: float) -> bool:
        """A timer due before this app started fires once the broker has nothing left for
        the saga's group (or ``catch_up_limit`` after the start); with a broker that cannot
        tell, once each saga consumer had a fetch that found nothing left."""
        if row.due >= self._started_at or now >= self._started_at + self.catch_up_limit:
            return True
        group = f"saga.{definition.name}"
        watched = self._caught_up.get(group, [])
        backlog = await self._backlog(group, watched, now)
        if backlog is not None:
            return backlog == 0
        return all(c.caught_up_at >= self._started_at for c in watched)

    async def _backlog(self, group: str, watched: Sequence[CaughtUp], now: float) -> int | None:
        """The group's backlog over its consumers' patterns, asked at most every
        ``_BACKLOG_CACHE`` seconds; None if the broker cannot tell (or cannot be asked)."""
        cached = self._backlogs.get(group)
        if (
            cached is not None
            and self._started_at <= cached[0]
            and now - cached[0] < _BACKLOG_CACHE
        ):
            return cached[1]
        total: int | None
        try:
            values = await asyncio.gather(*(c.backlog() for c in watched))
        except BrokerError as exc:
            _warn.warning(
                f"backlog {group}",
                "saga group %s: the broker did not tell its backlog (%s); overdue timers "
                "wait for an empty fetch instead",
                group,
                exc,
            )
            total = None
        else:
            total = None if None in values else sum(v for v in values if v is not None)
        self._backlogs[group] = (now, total)
        return total

    async def _fire(self, cls: type[Saga], row: TimerRow, lease: Lease) -> None:
        leases = self.sagas.persistence.store.leases

        async def fence(tx: Any) -> None:
            # Fenced: a holder that lost the lease (paused past it) commits nothing.
            await leases.fence(lease, tx)

        await self.sagas.handling.fire(cls, row, fence=fence)


def _timer_lease(definition: SagaDefinition) -> str:
    """The lease the timer loop of a saga holds, and the checkpoint its firings are fenced by."""
    return f"eventflow:saga-timers:{definition.name}"
