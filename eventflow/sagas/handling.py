"""One input applied to one saga in a store transaction: the code the runtime's handlers, its
timer loop, ``app.sagas`` (a person's retry, skip, abort) and the test kit all run.

- :meth:`Handling.apply`: load the saga, let a function apply the input with the machine,
  save the outcome in the transaction; when the saga's stream moved meanwhile (another
  input of the saga committed first), load and apply again (``conflicts``). Saga methods
  may so run more than once: they decide and build commands, participants do the work.
  The first try reads nothing when it can guess: a saga this process committed last
  (:meth:`~eventflow.sagas.persistence.SagaStore.recent`), or, for a start event, no saga
  yet; the append's version check tells a wrong guess, which then reads the store.
- :meth:`Handling.message`: the rules for a message (DESIGN 5): its saga key (the key
  field, else the message key); a start event starts the saga (then applies the inputs
  kept before it); any other input for a saga that has not started is kept (status
  ``pending``), never acked and lost; a second start starts nothing.
- :meth:`Handling.fire`: one timer firing, in a transaction of its own. Saga code that
  raises there leaves that saga ``failed`` with the error (``sagas retry`` fires it
  again); every other saga and timer goes on.

Saga code that raises while a message is applied raises out of :meth:`Handling.message`:
the handling fails like a handler's (retried, then dead-lettered), its transaction rolls
back and the saga is unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import orjson

from ..envelope import Envelope, hashed_id
from ..errors import ConcurrencyError
from ..events import Event, EventRegistry
from ..ports import Transaction
from .commands import envelopes
from .control import Control, Status
from .definition import Saga, SagaDefinition
from .machine import Early, Machine
from .persistence import Loaded, SagaStore, TimerRow

if TYPE_CHECKING:
    from ..telemetry.tracing import Tracing

__all__ = ["Handling", "Run", "build", "key_of", "timer_message_id"]

_log = logging.getLogger("eventflow.sagas")
_S = TypeVar("_S", bound=Saga)
_MAX_CONFLICTS = 50

Run = Callable[[Loaded | None, float], Awaitable[Machine | None]]
"""Applies one input: given the loaded saga (None: nothing stored) and the time, returns
the machine to save, or None to save nothing."""

Fence = Callable[[Transaction], Awaitable[None]]
AfterCommit = Callable[[Callable[[], None]], None]
"""Registers a call to make once the transaction of the input committed (never on a
rollback): ``ctx._after_commit`` for a handling."""


class Handling:
    """Applies inputs to the sagas kept in one store (see the module docstring)."""

    def __init__(
        self,
        persistence: SagaStore,
        registry: EventRegistry,
        source: str,
        clock: Callable[[], float],
        *,
        check: Callable[[Saga], None] | None = None,
    ) -> None:
        self.persistence = persistence
        self.check = check
        """Called with each saga before it is saved (the test kit checks its state there)."""
        self.registry = registry
        self.source = source
        self.clock = clock
        self.conflicts = 0
        """Handlings that found their saga changed by another and applied their input again."""
        self.stray = 0
        """Messages that name no saga key (logged, acked)."""
        self.failed_timers = 0
        """Timer firings whose saga code raised (each left its saga failed)."""
        self.tracing: Tracing | None = None
        """Set by the app whose tracing is on: each transition is a ``saga <name>`` span."""

    async def apply(
        self,
        tx: Transaction,
        cls: type[Saga],
        key: str,
        run: Run,
        *,
        cause: Envelope | None,
        new: bool = False,
        after_commit: AfterCommit | None = None,
        send: bool = False,
        handled: tuple[str, str] | None = None,
        checked_at_commit: bool = False,
    ) -> Machine | None:
        """Load the saga of ``key``, let ``run`` apply one input and save the outcome in
        ``tx``, again while the stream moved meanwhile. The first try guesses instead of
        reading when it can: the saga as this process last committed it, else, when
        ``new`` (a start event), no saga. Returns the machine saved, or None when ``run``
        declined. ``after_commit``: how to learn that ``tx`` committed (the saga then joins
        the recent ones). ``send``: queue the saved input's commands (:meth:`sends`) in the
        store's outbox too, with the save (with tracing on, after it, each in a span).
        ``handled``: the dedup entry (group, message id) of the input, which may ride on
        the save (``Writes.handled``). ``checked_at_commit``: the caller applies the input
        again when the commit of ``tx`` raises ``ConcurrencyError`` (``Writes``)."""
        args = (after_commit, send, handled, checked_at_commit)
        if self.tracing is None:
            return await self._apply(tx, cls, key, run, cause, new, *args)
        with self.tracing.saga(cls.definition.name, key) as span:
            args = (after_commit, False, handled, checked_at_commit)
            machine = await self._apply(tx, cls, key, run, cause, new, *args)
            if machine is not None:
                control = machine.control
                self.tracing.saga_state(span, control.at, control.status.value)
        if send and machine is not None:
            await self.queue(tx, self.sends(cls.definition, machine, cause))
        return machine

    async def _apply(
        self,
        tx: Transaction,
        cls: type[Saga],
        key: str,
        run: Run,
        cause: Envelope | None,
        new: bool,
        after_commit: AfterCommit | None,
        send: bool,
        handled: tuple[str, str] | None,
        checked_at_commit: bool,
    ) -> Machine | None:
        definition = cls.definition
        persistence = self.persistence
        loaded = persistence.recent(definition, key)
        guessed = loaded is not None or new
        for _ in range(_MAX_CONFLICTS):
            if not guessed:
                loaded = await persistence.load(definition, key)
            was = loaded.control.status if loaded is not None else None
            now = self.clock()
            machine = await run(loaded, now)
            if machine is None:
                return None
            if self.check is not None:
                self.check(machine.saga)
            try:
                committed = await persistence.save(
                    tx,
                    definition,
                    loaded.version if loaded is not None else 0,
                    machine.saga.model_dump(mode="json"),
                    machine.control,
                    machine.out,
                    source=self.source,
                    cause=cause,
                    now=now,
                    was=was,
                    sends=self.sends(definition, machine, cause) if send else (),
                    handled=handled,
                    # The commands go with the save (send), the mark rides: nothing after.
                    last=send and handled is not None,
                    checked_at_commit=checked_at_commit,
                )
            except ConcurrencyError:
                if loaded is not None:  # not a start that guessed wrong: a saga moved
                    self.conflicts += 1
                guessed = False
                continue
            if after_commit is not None:
                after_commit(committed)
            return machine
        raise ConcurrencyError(definition.stream_prefix + key, -1, -1)

    def sends(
        self, definition: SagaDefinition, machine: Machine, cause: Envelope | None
    ) -> list[tuple[str, Envelope]]:
        """What the saved input sends: (topic, envelope) pairs (:func:`.commands.envelopes`)."""
        return envelopes(definition, machine.control, machine.out, cause, source=self.source)

    async def queue(self, tx: Transaction, sends: list[tuple[str, Envelope]]) -> None:
        """Write ``sends`` to the store's outbox in ``tx`` (with tracing on, each in a
        ``send`` span whose context it carries: a timer's or a person's commands)."""
        outbox = self.persistence.store.outbox
        if self.tracing is None:
            await outbox.add(sends, tx=tx)
        else:
            await self.tracing.send_to_outbox(sends, lambda m: outbox.add(m, tx=tx))

    async def message(
        self,
        tx: Transaction,
        cls: type[Saga],
        event: Event,
        env: Envelope,
        *,
        after_commit: AfterCommit | None = None,
        send: bool = False,
        group: str | None = None,
        checked_at_commit: bool = False,
    ) -> Machine | None:
        """Apply the message ``env`` (decoded: ``event``) to its saga in ``tx``; None when
        it names no saga key (counted in ``stray``). ``after_commit``, ``send``,
        ``checked_at_commit``: see :meth:`apply`; ``group``: the consumer group handling
        it, whose dedup entry of ``env`` may then ride on the save (``Writes.handled``)."""
        definition = cls.definition
        key = key_of(definition, event, env.key)
        if key is None:
            self.stray += 1
            _log.warning(
                "saga %s: %s %s names no saga key (%s field or message key); acked",
                definition.name,
                env.type,
                env.id,
                definition.key,
            )
            return None
        is_start = event.event_type == definition.start.event_type

        async def run(loaded: Loaded | None, now: float) -> Machine:
            if loaded is None or loaded.control.status is Status.PENDING:
                control = loaded.control if loaded is not None else Control(key=key)
                machine = Machine(cls(), control, now)
                if is_start:
                    early = [self._early(cls, k.envelope) for k in control.kept]
                    await machine.start(event, env.id, env.correlation_id, early)
                else:
                    machine.keep(orjson.loads(env.to_bytes()), env.id, env.type)
                return machine
            machine = Machine(build(cls, loaded), loaded.control, now)
            if is_start:
                machine.ignored(env.id, f"a second {env.type} for {key}: starts nothing")
            else:
                await machine.message(event, env.id, env.causation_id)
            return machine

        return await self.apply(
            tx,
            cls,
            key,
            run,
            cause=env,
            new=is_start,
            after_commit=after_commit,
            send=send,
            handled=None if group is None else (group, env.id),
            checked_at_commit=checked_at_commit and group is not None,
        )

    def _early(self, cls: type[Saga], raw: dict[str, object]) -> Early:
        """A kept input, decoded as the class the saga takes for its type."""
        env = Envelope.from_mapping(raw)
        takes = {c.event_type: c for c in cls.definition.input_types()}
        event = self.registry.decode_as(env, takes[env.type])
        return Early(event, env.id, env.causation_id)

    async def fire(
        self, cls: type[Saga], row: TimerRow, *, fence: Fence | None = None
    ) -> Machine | None:
        """Fire the timer ``row`` in a store transaction of its own (fenced by ``fence``
        when given: the timer lease). Its commands go to the outbox. A timer cancelled or
        rescheduled meanwhile (or of a saga gone) changes nothing and its row is dropped.
        Saga code that raises leaves the saga ``failed`` there (logged, counted in
        ``failed_timers``). Returns the machine saved (None: no saga)."""
        definition = cls.definition
        store = self.persistence.store
        message_id = timer_message_id(row)

        async def run(loaded: Loaded | None, now: float) -> Machine | None:
            if loaded is None:
                return None
            before = loaded.control.as_dict()
            machine = Machine(build(cls, loaded), loaded.control, now)
            try:
                await machine.timer(row.timer, row.token, message_id)
            except Exception as exc:
                self.failed_timers += 1
                _log.error(
                    "saga %s: timer %s of %s raised %r: the saga is failed there (`eventflow "
                    "sagas retry %s` fires it again)",
                    definition.name,
                    row.timer,
                    row.saga_id,
                    exc,
                    row.saga_id,
                    exc_info=exc,
                )
                control = Control.from_dict(before)
                machine = Machine(build(cls, Loaded(0, loaded.state, control)), control, now)
                machine.timer_failed(row.timer, row.token, message_id, repr(exc))
            return machine

        committed: list[Callable[[], None]] = []
        async with store.transaction() as tx:
            machine = await self.apply(
                tx, cls, row.key, run, cause=None, after_commit=committed.append, send=True
            )
            if machine is None or not machine.out.changed:
                await self.persistence.drop_timer(tx, row)  # cancelled or rescheduled
            if fence is not None:
                await fence(tx)
        for call in committed:
            call()
        return machine


def build(cls: type[_S], loaded: Loaded) -> _S:
    """The saga of ``cls`` as loaded, with its key, status and reason."""
    saga = cls.model_validate(loaded.state)
    c = loaded.control
    saga._meta.update(key=c.key, status=c.status.value, reason=c.reason)
    return saga


def key_of(definition: SagaDefinition, event: Event, message_key: str | None) -> str | None:
    """The saga key of an input: its key field, else the message key (None: neither)."""
    value = getattr(event, definition.key, None)
    if value is not None and value != "":
        return str(value)
    return message_key


def timer_message_id(row: TimerRow) -> str:
    """The id a timer firing is recorded with (the same on every re-run of the firing)."""
    return hashed_id(0, "saga-timer", row.saga_id, row.timer, row.token)
