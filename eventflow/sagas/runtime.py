"""Running sagas in an app: their handlers and ``app.sagas``.

Each saga class gets one ``@subscribe``-style handler per event type it takes (its start,
replies, rejections, abort), all in the consumer group ``saga.<name>``. A handling loads the
saga from its stream, applies the message (:class:`~eventflow.sagas.machine.Machine`) and
saves the outcome inside ``ctx.transaction()``: the transitions, the index, the timers, the
commands (through the outbox) and the message's dedup entry commit together. A conflict on
the stream (two messages of one saga at once, on different topics) reloads and applies the
message again, counted in ``conflicts``.

Timers: :mod:`eventflow.sagas.timers` (one loop per saga class).
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from .._logging import Throttled
from ..context import Context
from ..envelope import Envelope, hashed_id
from ..errors import ConcurrencyError, ConfigurationError
from ..events import Event, EventRegistry, envelope_for
from ..headers import TRACEPARENT_HEADER
from ..ports import Broker, Store, Transaction
from ..runtime.retry import RetryPolicy
from ..subscribe import HandlerSpec
from .definition import Saga, SagaDefinition
from .machine import STATUSES, Control, Machine, Outcome, Transition
from .persistence import IndexRow, Loaded, SagaStore
from .persistence import build_saga as _build
from .timers import DEFAULT_CATCH_UP_LIMIT, SagaTimers

__all__ = ["DEFAULT_CATCH_UP_LIMIT", "SagaRuntime", "Sagas"]

_log = logging.getLogger("eventflow.sagas")
_warn = Throttled(_log)
_S = TypeVar("_S", bound=Saga)
_MAX_CONFLICTS = 50


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

    A saga class need not be among the app's ``sagas=`` to be read.
    """

    def __init__(self, store: Store, registry: EventRegistry, source: str) -> None:
        self._store = store
        self._registry = registry
        self._source = source
        self._persistence: SagaStore | None = None
        self.conflicts = 0
        """Handlings that found their saga changed by another and applied their message again."""
        self.stray = 0
        """Messages for a saga key with no saga (logged, acked)."""
        self.classes: tuple[type[Saga], ...] = ()
        """The saga classes the app runs (its ``sagas=``)."""
        self.committed: Callable[[str, list[float]], None] | None = None
        """Called after a person's input committed, with the saga's name and the delays of
        the timers it set (the app's timer loops: ``SagaTimers.committed``)."""

    @property
    def persistence(self) -> SagaStore:
        """The store's saga tables (made on first use)."""
        if self._persistence is None:
            self._persistence = SagaStore(self._store)
        return self._persistence

    async def get(self, cls: type[_S], key: str) -> _S | None:
        """The saga of ``key`` with its ``status`` and ``history``, or None."""
        loaded = await self.persistence.load(cls.definition, key)
        if loaded is None:
            return None
        saga = _build(cls, loaded)
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

    async def _act(self, cls: type[Saga], key: str, what: Callable[[Machine], Any]) -> Outcome:
        """Apply a person's input in a store transaction of its own."""
        definition = cls.definition
        await self.persistence.setup()

        async def run(loaded: Loaded | None, now: float) -> Machine:
            if loaded is None:
                raise ConfigurationError(
                    f"no saga {definition.stream_prefix}{key}: check the id with "
                    "`eventflow sagas list`"
                )
            machine = Machine(_build(cls, loaded), loaded.control, now)
            await what(machine)
            return machine

        async with self._store.transaction() as tx:
            machine = await self.apply(tx, cls, key, run, cause=None)
            assert machine is not None  # run never declines
            await self._store.outbox.add(
                self.commands(definition, machine.control, machine.out, None), tx=tx
            )
        if self.committed is not None:
            timers = machine.out.timers_set.values()
            self.committed(definition.name, [due - machine.now for due, _ in timers])
        return machine.out

    async def apply(
        self,
        tx: Transaction,
        cls: type[Saga],
        key: str,
        run: Callable[[Loaded | None, float], Awaitable[Machine | None]],
        *,
        cause: Envelope | None,
    ) -> Machine | None:
        """Load the saga of ``key``, let ``run`` apply one input to it (given the loaded
        saga, None if it never started, and the time) and save the outcome in ``tx``. When
        the stream moved meanwhile (another input of the saga committed first), load and
        apply again, counted in ``conflicts``. Returns the machine that was saved, or None
        when ``run`` declined (returned None: nothing is saved)."""
        definition = cls.definition
        for _ in range(_MAX_CONFLICTS):
            loaded = await self.persistence.load(definition, key)
            now = time.time()
            machine = await run(loaded, now)
            if machine is None:
                return None
            try:
                await self.persistence.save(
                    tx,
                    definition,
                    loaded.version if loaded is not None else 0,
                    machine.saga.model_dump(mode="json"),
                    machine.control,
                    machine.out,
                    source=self._source,
                    cause=cause,
                    now=now,
                )
            except ConcurrencyError:
                self.conflicts += 1
                continue
            return machine
        raise ConcurrencyError(definition.stream_prefix + key, -1, -1)

    def commands(
        self,
        definition: SagaDefinition,
        control: Control,
        outcome: Outcome,
        cause: Envelope | None,
    ) -> builtins.list[tuple[str, Envelope]]:
        """The (topic, envelope) pairs of an input's commands and messages, with the saga's
        key: each command keeps the id the machine gave it (the same on every re-run); a
        plain message from a timer method gets one numbered within its input."""
        out: builtins.list[tuple[str, Envelope]] = []
        correlation = cause.correlation_id if cause is not None else control.correlation_id
        parent = cause.headers.get(TRACEPARENT_HEADER) if cause is not None else None
        sent: builtins.list[tuple[Event, str | None]] = [*outcome.commands]
        sent.extend((m, None) for m in outcome.messages)
        for n, (event, command_id) in enumerate(sent):
            if command_id is None:
                command_id = hashed_id(
                    control.origin_ms, definition.name, control.key, str(control.seq), str(n)
                )
            env = envelope_for(
                event,
                source=self._source,
                key=control.key,
                correlation_id=correlation,
                causation_id=cause.id if cause is not None else None,
                parent_traceparent=parent,
                id=command_id,
            )
            out.append((env.type, env))
        return out


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
                        group=f"saga.{cls.definition.name}",
                        concurrency=8,
                        retry=RetryPolicy.of(5),
                        timeout=30.0,
                        dead_letter=True,
                        idempotent=True,
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
        definition = cls.definition
        key = _key_of(definition, event, env)
        if key is None:
            self.sagas.stray += 1
            _log.warning(
                "saga %s: %s %s names no saga key (%s field or message key); acked",
                definition.name,
                env.type,
                env.id,
                definition.key,
            )
            return
        is_start = event.event_type == definition.start.event_type

        async def run(loaded: Loaded | None, now: float) -> Machine | None:
            if loaded is None and not is_start:
                self.sagas.stray += 1
                _log.warning(
                    "saga %s: no saga %s for %s %s; acked", definition.name, key, env.type, env.id
                )
                return None
            if loaded is None:
                machine = Machine(cls(), Control(key=key), now)
                await machine.start(event, env.id, env.correlation_id)
                return machine
            machine = Machine(_build(cls, loaded), loaded.control, now)
            if is_start:
                machine.ignored(env.id, f"a second {env.type} for {key}: starts nothing")
            else:
                await machine.message(event, env.id, env.causation_id)
            return machine

        async with ctx.transaction() as tx:
            saved = await self.sagas.apply(tx, cls, key, run, cause=env)
        if saved is None:
            self.timers.after_handling(ctx, definition, {}, 0.0)
            return
        machine = saved
        for topic, command in self.sagas.commands(definition, machine.control, machine.out, env):
            await ctx.publish(command, topic=topic)
        self.timers.after_handling(ctx, definition, machine.out.timers_set, machine.now)


def _key_of(definition: SagaDefinition, event: Event, env: Envelope) -> str | None:
    value = getattr(event, definition.key, None)
    if value is not None and value != "":
        return str(value)
    return env.key
