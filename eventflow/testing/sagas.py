"""Testing a saga in-process, given/when/then, on a virtual clock: no broker, no real time.

:class:`SagaTest` runs the runtime's own code (:mod:`eventflow.sagas.handling`: the message
rules, the timer firing, a person's retry, skip and abort) on a memory store whose clock is
the test's virtual clock, one input at a time, so it cannot drift from the runtime::

    t = SagaTest(OrderSaga)
    await t.given(OrderPlaced(order_id="o-1", sku="s", qty=1, amount=100))
    await t.when_reply(StockReserved(order_id="o-1"))   # answers the waiting ReserveStock
    await t.when_reply(PaymentDeclined(order_id="o-1"))
    t.then_sent(ReserveStock, ChargePayment, ReleaseStock).then_status("compensated")
    await t.advance(30)                                  # fires every timer due, in order

Between inputs the saga is saved in the store and loaded back as the runtime does, and its
fields are checked to read back equal after JSON, so a test fails on state that would not
survive a reload. Input events and the commands sent go through the envelope path of the
runtime (``envelope_for``, the wire bytes, decoding), so an event that could not be sent
fails here too. Timers are the store's timer rows; they fire when :meth:`SagaTest.advance`
moves the clock past them, earliest first, through the timer loop's firing code (saga code
that raises in a timer leaves the saga ``failed``, as in an app). An input sent before the
start (``.when(event, key=...)``) is kept and applied after it, as in an app.

Command ids are the runtime's: derived from the saga, the step and the attempt, and from
the clock at the start (fixed by default), so the same inputs give the same ids.

A test that asks for something the saga cannot do (a reply while nothing waits, a timer
that is not set) raises :class:`SagaTestError` saying what the saga waits for; the
``then_*`` checks raise ``AssertionError`` with what the saga did instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Generic, TypeVar

import orjson
from pydantic import ValidationError

from ..adapters.memory import MemoryStore
from ..envelope import Envelope, hashed_id
from ..events import Event, EventRegistry, envelope_for
from ..sagas.commands import envelopes
from ..sagas.control import ENDED, STATUSES, Action, Control, Status, Timer, Wait
from ..sagas.definition import Saga, SagaDefinition
from ..sagas.handling import key_of, timer_message_id
from ..sagas.machine import Outcome, Transition
from ..sagas.persistence import TimerRow
from ..sagas.runtime import Sagas

__all__ = ["DEFAULT_START", "Applied", "SagaTest", "SagaTestError", "Sent"]

S = TypeVar("S", bound=Saga)

DEFAULT_START = 1_767_225_600.0
"""The virtual clock's default start (2026-01-01T00:00:00Z): fixed, so ids repeat."""

_SOURCE = "sagatest"
_MAX_AT_ONCE = 1_000  # timers fired at one instant: past it one keeps setting itself
_DECODER = EventRegistry()  # decodes an input as its own class: no upcaster is involved


class SagaTestError(AssertionError):
    """A saga test asked for something the saga cannot do (the message says what it waits
    for and what to call instead)."""


@dataclass(frozen=True)
class Sent:
    """A command, a compensation or a plain message (from a timer method) the saga sent."""

    event: Event
    id: str
    """The envelope id (the runtime's: the same inputs give the same id)."""
    kind: str
    """``command``, ``compensation`` or ``message``."""
    step: str | None
    attempt: int | None
    envelope: Envelope
    """The envelope the runtime would publish (key, correlation and causation ids)."""

    def __repr__(self) -> str:
        where = f" {self.kind} of {self.step}, attempt {self.attempt}" if self.step else ""
        return f"<{type(self.event).__name__}{where} id={self.id}>"


@dataclass(frozen=True)
class Applied:
    """One input applied to the saga, and what it did."""

    input: str
    """What the input was, e.g. ``reply StockReserved`` or ``timer step:ship``."""
    message_id: str | None
    transitions: tuple[Transition, ...]
    sent: tuple[Sent, ...]
    timers_set: dict[str, float]
    """Timers set by this input: name -> seconds from the input to the timer's due time."""
    timers_cancelled: frozenset[str]

    @property
    def kinds(self) -> list[str]:
        """The kinds of this input's transitions, in order."""
        return [t.kind for t in self.transitions]


class SagaTest(Generic[S]):
    """One saga of ``saga_class`` under test, on a virtual clock starting at ``start``
    (Unix seconds or an aware datetime; :data:`DEFAULT_START` unless given).

    Inputs are coroutines (step methods may be async): :meth:`given`, :meth:`when`,
    :meth:`when_reply`, :meth:`advance`, :meth:`elapse`, :meth:`retry`, :meth:`skip`,
    :meth:`abort`; each returns what it :class:`Applied`. Checks are plain methods that
    return the test, so they chain: ``t.then_sent(...).then_status(...)``.
    """

    def __init__(self, saga_class: type[S], *, start: float | datetime = DEFAULT_START) -> None:
        if not (
            isinstance(saga_class, type)
            and issubclass(saga_class, Saga)
            and "definition" in vars(saga_class)
        ):
            raise SagaTestError(
                f"SagaTest takes a Saga subclass declared with name=, start=, key=; "
                f"got {saga_class!r}"
            )
        self.saga_class = saga_class
        self.definition: SagaDefinition = saga_class.definition
        self._start = start.timestamp() if isinstance(start, datetime) else float(start)
        self._now = self._start
        self._store = MemoryStore(clock=self._clock)
        self._sagas = Sagas(
            self._store, _DECODER, _SOURCE, clock=self._clock, check=self._check_state
        )
        self._key: str | None = None
        self._state: bytes | None = None  # the saga's fields as last saved
        self._control: Control | None = None
        self._history: list[Transition] = []
        self._superseded: dict[str, list[Timer]] = {}  # timer name -> old settings, newest last
        self._inputs = 0
        self._sent: list[Sent] = []
        self._applied: list[Applied] = []
        self._inputs_by_type = {c.event_type: c for c in self.definition.input_types()}

    def _clock(self) -> float:
        return self._now

    # -- what the test sees ---------------------------------------------------------------

    @property
    def started(self) -> bool:
        """True once :meth:`given` started the saga."""
        return self._control is not None and self._control.status is not Status.PENDING

    @property
    def saga(self) -> S:
        """The saga as loaded after the last input: its fields, ``status``, ``reason``,
        ``key``, ``id`` and ``history`` (a fresh copy each time)."""
        self._require_started("read .saga")
        assert self._state is not None
        saga = self.saga_class.model_validate(orjson.loads(self._state))
        c = self._control_now()
        saga._meta.update(key=c.key, status=c.status.value, reason=c.reason)
        saga._meta["history"] = self.history
        return saga

    @property
    def status(self) -> str:
        """The saga's status (``pending``, ``running``, ``completed``, ``compensating``, ...)."""
        return self._control_now().status.value

    @property
    def control(self) -> Control:
        """A copy of the saga's control state (where it is, what it waits for)."""
        return Control.from_dict(self._control_now().as_dict())

    @property
    def history(self) -> list[Transition]:
        """Every transition so far, oldest first (as the saga's stream holds them)."""
        return list(self._history)

    @property
    def sent(self) -> list[Sent]:
        """Everything the saga sent so far, in order."""
        return list(self._sent)

    @property
    def applied(self) -> list[Applied]:
        """Every input applied so far, in order."""
        return list(self._applied)

    @property
    def last(self) -> Applied:
        """The last input applied."""
        if not self._applied:
            raise SagaTestError("nothing applied yet: start the saga with .given(...)")
        return self._applied[-1]

    @property
    def now(self) -> datetime:
        """The virtual clock (UTC)."""
        return datetime.fromtimestamp(self._now, UTC)

    @property
    def elapsed(self) -> float:
        """Virtual seconds since the test's start."""
        return self._now - self._start

    @property
    def timers(self) -> dict[str, float]:
        """The timers set: name -> seconds until due (``step:<step>`` is a step's or a
        compensation's deadline, ``retry:<step>`` a backoff, others the saga's own)."""
        if self._control is None:
            return {}
        ordered = sorted(self._control.timers.values(), key=lambda t: t.due)
        return {t.key: t.due - self._now for t in ordered}

    @property
    def waits_for(self) -> str:
        """What the saga waits for, in words."""
        if not self.started:
            kept = "" if self._control is None else f" ({len(self._control.kept)} inputs kept)"
            return (
                f"the saga has not started{kept}: start it with "
                f".given({self.definition.start.__name__}(...))"
            )
        c = self._control_now()
        if c.status in ENDED:
            return f"the saga is {c.status} and waits for nothing"
        if c.status is Status.FAILED:
            return (
                f"the saga is failed ({c.reason}) and waits for a person: "
                ".retry(by=...) issues the step again, .skip(by=...) goes on past it"
            )
        w = c.waiting
        if w is None:
            return "nothing"
        s = self.definition.find(w.step)
        if s is None:
            return f"step {w.step}, which the saga's definition no longer has"
        timer = c.timers.get(f"{'retry' if w.wait is Wait.BACKOFF else 'step'}:{s.name}")
        due = "" if timer is None else f", due in {timer.due - self._now:g}s"
        if w.wait is Wait.BACKOFF:
            attempt = c.attempts.get(s.name, 1) + 1
            return f"step {s.name} waits for its attempt {attempt}{due}: call .advance(...)"
        if w.wait is Wait.UNDO:
            assert s.compensation is not None
            return (
                f"compensation {s.compensation.name} of step {s.name} waits for "
                f"{_names(s.compensation.reply)} (command {w.command_id}{due})"
            )
        return (
            f"step {s.name} waits for {_names((*s.reply, *s.reject))} (command {w.command_id}{due})"
        )

    # -- inputs ---------------------------------------------------------------------------

    async def given(self, event: Event, *, key: str | None = None) -> Applied:
        """Start the saga with its start event (``key``: the message key, used when the
        event's key field is empty). Inputs sent before it are applied right after it."""
        if self.started:
            raise SagaTestError(
                "the saga has already started; a second start event is an input like any "
                "other: send it with .when(event)"
            )
        if event.event_type != self.definition.start.event_type:
            raise SagaTestError(
                f"{self.definition.name} starts with {self.definition.start.__name__}, not "
                f"{type(event).__name__}"
            )
        key = key_of(self.definition, event, key)
        if key is None:
            raise SagaTestError(
                f"{type(event).__name__}.{self.definition.key} is empty: give the saga's "
                "key there or as .given(event, key=...)"
            )
        self._check_key(event, key)
        env, decoded = self._input(event, key, correlation_id=None, causation_id=None)
        return await self._message(f"start {type(event).__name__}", decoded, env, key)

    async def when(
        self, event: Event, *, causation_id: str | None = None, key: str | None = None
    ) -> Applied:
        """Any input event for the saga's key (a reply, a rejection, an abort event, a
        second start event), as the runtime would hand it over. ``causation_id``: the
        command it answers (None: a foreign producer's message, matched by type). Before
        the start it is kept and applied after it (``key``: the saga's key, when the
        event's key field does not give it)."""
        if self._key is None:
            key = key_of(self.definition, event, key)
            if key is None:
                raise SagaTestError(
                    f"the saga has not started and {type(event).__name__} names no key: "
                    "give it as .when(event, key=...)"
                )
        else:
            key = self._key
        self._check_key(event, key)
        c = self._control
        env, decoded = self._input(
            event,
            key,
            correlation_id=c.correlation_id if c is not None else None,
            causation_id=causation_id,
        )
        return await self._message(f"message {type(event).__name__}", decoded, env, key)

    async def when_reply(self, event: Event, *, to: Sent | str | None = None) -> Applied:
        """A participant's reply to the command the saga waits for (its causation id is
        that command's id, as ``ctx.publish`` sets it). ``to``: answer another command
        instead (a :class:`Sent` or its id), e.g. a late reply to an earlier attempt."""
        self._require_started(f"reply {type(event).__name__}")
        if to is not None:
            return await self.when(event, causation_id=to.id if isinstance(to, Sent) else to)
        c = self._control_now()
        w = c.waiting
        what = type(event).__name__
        if c.status in ENDED or c.status is Status.FAILED or w is None or w.wait is Wait.BACKOFF:
            raise SagaTestError(
                f"{what} replies to nothing: {self.waits_for}. To send it anyway (a late or "
                "stray reply), use .when(event) or .when_reply(event, to=<a Sent>)"
            )
        s = self.definition.find(w.step)
        if s is None:
            raise SagaTestError(f"{what} replies to nothing: {self.waits_for}")
        if w.wait is Wait.UNDO:
            assert s.compensation is not None
            takes, answering = s.compensation.reply, f"compensation {s.compensation.name}"
        else:
            takes, answering = (*s.reply, *s.reject), f"step {s.name}"
        if all(event.event_type != cls.event_type for cls in takes):
            raise SagaTestError(
                f"{what} does not answer {answering}, which waits for {_names(takes)}; "
                "to send it anyway, use .when(event)"
            )
        return await self.when(event, causation_id=w.command_id)

    async def advance(self, seconds: float) -> list[Applied]:
        """Move the virtual clock ``seconds`` on, firing every timer due on the way (step
        deadlines, retry backoffs, named timers) at its due time, earliest first, as the
        timer loop fires them; timers that firing sets are fired too when due in the span."""
        if seconds < 0:
            raise SagaTestError(f"advance({seconds!r}): the clock only goes forward")
        self._require_started("advance the clock")
        target = self._now + seconds
        fired: list[Applied] = []
        at_once = 0  # firings without the clock moving
        while True:
            rows, _ = await self._sagas.persistence.earliest(self.definition.name, 1)
            if not rows or rows[0].due > target:
                self._now = target
                return fired
            row = rows[0]
            at_once = at_once + 1 if row.due <= self._now else 1
            if at_once > _MAX_AT_ONCE:
                raise SagaTestError(
                    f"{_MAX_AT_ONCE} timers fired at one instant ({self.elapsed:g}s in), the "
                    f"last {row.timer}: a timer keeps setting itself due at once"
                )
            self._now = max(self._now, row.due)
            fired.append(await self._fire(row))

    async def elapse(self, timer: str) -> list[Applied]:
        """Move the clock to when ``timer`` is due and fire it (and every timer due before
        it), e.g. ``await t.elapse("step:ship")``."""
        self._require_started(f"elapse {timer}")
        current = self._control_now().timers.get(timer)
        if current is None:
            raise SagaTestError(f"timer {timer} is not set; set timers: {self.timers or 'none'}")
        return await self.advance(max(0.0, current.due - self._now))

    async def fire_stale(self, timer: str) -> Applied:
        """Fire the last setting of ``timer`` that was rescheduled or cancelled, as a timer
        loop that read it just before the change would (it must change nothing)."""
        self._require_started(f"fire {timer}")
        old = self._superseded.get(timer)
        if not old:
            raise SagaTestError(f"timer {timer} has no rescheduled or cancelled setting")
        c, stale = self._control_now(), old.pop()
        saga_id = self.definition.stream_prefix + c.key
        row = TimerRow(saga_id, stale.row, self.definition.name, c.key, stale.due, stale.token)
        return await self._fire(row, stale.key)

    async def retry(self, *, by: str | None = None) -> Applied:
        """``eventflow sagas retry``: issue the failed step (or compensation) again under a
        new attempt, or fire again the timer that raised (on a saga that is not failed it
        is recorded as ignored)."""
        return await self._person(
            f"retry by {by}", lambda: self._sagas.retry(self.saga_class, self._keyed(), by=by)
        )

    async def skip(self, *, by: str | None = None) -> Applied:
        """``eventflow sagas skip``: a person handled the failed step by hand; go on."""
        return await self._person(
            f"skip by {by}", lambda: self._sagas.skip(self.saga_class, self._keyed(), by=by)
        )

    async def abort(self, *, by: str | None = None, reason: str = "aborted") -> Applied:
        """``eventflow sagas abort``: compensate what was done (ignored after the pivot)."""
        return await self._person(
            f"abort by {by}",
            lambda: self._sagas.abort(self.saga_class, self._keyed(), by=by, reason=reason),
        )

    def deploy(self, saga_class: type[Saga]) -> None:
        """A deploy: the saga runs on with ``saga_class`` (declared with the same
        ``name=``), its stored fields and control state as they are, as an app's saga
        does after a release that adds, removes or reorders steps."""
        if not (isinstance(saga_class, type) and "definition" in vars(saga_class)):
            raise SagaTestError(f"deploy takes a Saga subclass, got {saga_class!r}")
        if saga_class.definition.name != self.definition.name:
            raise SagaTestError(
                f"deploy({saga_class.__name__}): it is the saga {saga_class.definition.name!r}, "
                f"this test's saga is {self.definition.name!r} (a deploy keeps the name)"
            )
        self.saga_class = saga_class  # type: ignore[assignment]
        self.definition = saga_class.definition
        self._inputs_by_type = {c.event_type: c for c in self.definition.input_types()}

    # -- checks ---------------------------------------------------------------------------

    def then_status(self, status: str, *, reason: str | None = None) -> SagaTest[S]:
        """Check the status (and that ``reason`` is part of the saga's reason)."""
        if status not in STATUSES:
            raise SagaTestError(f"status {status!r}: one of {', '.join(STATUSES)}")
        c = self._control_now()
        if c.status != status or (reason is not None and reason not in (c.reason or "")):
            raise AssertionError(
                f"expected {status}{f' ({reason})' if reason else ''}, the saga is "
                f"{c.status} (reason: {c.reason}); {self.waits_for}\n{self._history_table()}"
            )
        return self

    def then_sent(self, *expected: type[Event] | Event) -> SagaTest[S]:
        """Check everything sent so far, in order: each item an Event class (any event of
        its type) or an event (equal to it). No items: nothing was sent."""

        def same(sent: Sent, want: type[Event] | Event) -> bool:
            if isinstance(want, Event):
                return sent.event == want
            return sent.event.event_type == want.event_type

        if len(self._sent) != len(expected) or not all(
            same(s, w) for s, w in zip(self._sent, expected, strict=False)
        ):
            wanted = ", ".join(w.__name__ if isinstance(w, type) else repr(w) for w in expected)
            raise AssertionError(
                f"expected sent: [{wanted}]\nsent:\n{self._sent_table()}\n{self._history_table()}"
            )
        return self

    def then_waiting(self, step: str, kind: str = "do") -> SagaTest[S]:
        """Check the saga waits on ``step``: for its reply (``do``), its compensation's
        reply (``undo``) or its next attempt (``retry``)."""
        w = self._control_now().waiting
        if w is None or w.step != step or w.wait.value != kind:
            raise AssertionError(f"expected to wait on {step} ({kind}); {self.waits_for}")
        return self

    def then_recorded(
        self, kind: str, *, step: str | None = None, detail: str | None = None
    ) -> SagaTest[S]:
        """Check the history holds a transition of ``kind`` (for ``step``, with ``detail``
        in its text when given)."""
        for t in self.history:
            if (
                t.kind == kind
                and (step is None or t.step == step)
                and (detail is None or detail in t.detail)
            ):
                return self
        raise AssertionError(
            f"no {kind} transition (step={step!r}, detail={detail!r}) in the history:\n"
            f"{self._history_table()}"
        )

    # -- the machinery: the runtime's own handling on the memory store ---------------------

    def _require_started(self, what: str) -> None:
        if not self.started:
            raise SagaTestError(f"cannot {what}: {self.waits_for}")

    def _control_now(self) -> Control:
        if self._control is None:
            raise SagaTestError(self.waits_for)
        return self._control

    def _keyed(self) -> str:
        assert self._key is not None
        return self._key

    def _check_key(self, event: Event, key: str) -> None:
        if self._key is not None and key_of(self.definition, event, key) != self._key:
            raise SagaTestError(
                f"{type(event).__name__}.{self.definition.key} is "
                f"{getattr(event, self.definition.key)!r}: it is for another saga than "
                f"this one ({self._key!r})"
            )

    def _input(
        self, event: Event, key: str, *, correlation_id: str | None, causation_id: str | None
    ) -> tuple[Envelope, Event]:
        """The envelope of an input (as a participant would publish it) and the event the
        saga's handler would decode from its bytes."""
        cls = self._inputs_by_type.get(event.event_type)
        if cls is None:
            raise SagaTestError(
                f"{self.definition.name} takes no {type(event).__name__} "
                f"({event.event_type}); it takes {_names(tuple(self._inputs_by_type.values()))}"
            )
        self._inputs += 1
        message_id = hashed_id(
            int(self._now * 1000), _SOURCE, self.definition.name, key, str(self._inputs)
        )
        env = envelope_for(
            event,
            source=_SOURCE,
            key=key,
            correlation_id=correlation_id,
            causation_id=causation_id,
            id=message_id,
        )
        wire = Envelope.from_bytes(env.to_bytes())
        return wire, _DECODER.decode_as(wire, cls)

    async def _message(self, what: str, event: Event, env: Envelope, key: str) -> Applied:
        """A message, as the saga's handler applies it (in the handling's transaction)."""
        handling = self._sagas.handling
        await self._sagas.persistence.setup()
        async with self._store.transaction() as tx:
            machine = await handling.message(tx, self.saga_class, event, env)
            assert machine is not None  # the key was checked
        self._key = key
        sent = handling.sends(self.definition, machine, env)
        return await self._saved(what, env.id, machine.out, sent)

    async def _fire(self, row: TimerRow, name: str | None = None) -> Applied:
        """A timer firing, through the timer loop's own code (``name``: the timer's, when
        its setting is not the current one)."""
        current = self._control_now().timer_at(row.timer)
        if name is None:
            name = current.key if current is not None else row.timer
        handling = self._sagas.handling
        machine = await handling.fire(self.saga_class, row)
        assert machine is not None  # the saga exists
        sent = handling.sends(self.definition, machine, None)
        return await self._saved(f"timer {name}", timer_message_id(row), machine.out, sent)

    async def _person(self, what: str, act: Callable[[], Awaitable[Outcome]]) -> Applied:
        self._require_started(what)
        out = await act()
        loaded = await self._sagas.persistence.load(self.definition, self._keyed())
        assert loaded is not None
        sent = envelopes(self.definition, loaded.control, out, None, source=_SOURCE)
        return await self._saved(what, None, out, sent)

    async def _saved(
        self, what: str, message_id: str | None, out: Outcome, pairs: list[tuple[str, Envelope]]
    ) -> Applied:
        """Read back what the store now holds, and record what the input did."""
        loaded = await self._sagas.persistence.load(self.definition, self._keyed())
        assert loaded is not None
        before = self._control
        self._state = orjson.dumps(loaded.state)
        self._control = loaded.control
        saga_id = self.definition.stream_prefix + self._keyed()
        self._history = [
            Transition.from_dict(d) for d in await self._sagas.persistence.history(saga_id)
        ]
        old = {} if before is None else dict(before.timers)
        after = self._control.timers
        gone = {k for k, t in old.items() if k not in after or after[k].token != t.token}
        for name in gone:
            self._superseded.setdefault(name, []).append(old[name])
        # The outcome names timer rows; the test names timers (a saga's deadline and
        # backoff share one row, moved from step to step).
        set_now = {t.key: t.due - self._now for t in after.values() if t.row in out.timers_set}
        cancelled = {k for k in gone if old[k].row in out.timers_cancelled or k not in after}
        sent = [_sent(n, out, env) for n, (_topic, env) in enumerate(pairs)]
        self._sent.extend(sent)
        applied = Applied(
            what,
            message_id,
            tuple(out.transitions),
            tuple(sent),
            set_now,
            frozenset(cancelled - set(set_now)),
        )
        self._applied.append(applied)
        return applied

    def _check_state(self, saga: Saga) -> None:
        """The saga's fields as saved must load back equal (the runtime loads the saga
        before every input)."""
        cls = type(saga).__name__
        try:
            raw = orjson.dumps(saga.model_dump(mode="json", warnings=False))
        except (TypeError, ValueError, orjson.JSONEncodeError) as exc:
            raise SagaTestError(
                f"{cls}'s state cannot be saved as JSON ({exc}): give each field a type "
                "pydantic can write and read back"
            ) from exc
        try:
            reloaded = self.saga_class.model_validate(orjson.loads(raw))
        except ValidationError as exc:
            raise SagaTestError(
                f"{cls}'s state would not load back after a reload: {exc}; assign each field "
                "a value of its declared type"
            ) from exc
        for name in self.saga_class.model_fields:
            before, after = getattr(saga, name), getattr(reloaded, name)
            if before != after:
                raise SagaTestError(
                    f"{cls}.{name} = {before!r} reads back as {after!r} after a reload (the "
                    "runtime loads the saga before every input): assign it a value of its "
                    "declared type"
                )

    def _sent_table(self) -> str:
        if not self._sent:
            return "  (nothing)"
        return "\n".join(f"  {n}. {s!r}" for n, s in enumerate(self._sent, 1))

    def _history_table(self) -> str:
        rows = [
            f"  +{t.at.timestamp() - self._start:g}s {t.kind}"
            f"{f' [{t.step}]' if t.step else ''}{f': {t.detail}' if t.detail else ''}"
            f"{f' (by {t.by})' if t.by else ''}"
            for t in self.history
        ]
        return "history:\n" + ("\n".join(rows) if rows else "  (empty)")


def _sent(n: int, out: Outcome, env: Envelope) -> Sent:
    """The ``n``-th thing an input sends (its commands come first, then its messages)."""
    if n < len(out.commands):
        c = out.commands[n]
        kind = "command" if c.action is Action.DO else "compensation"
        return Sent(c.event, env.id, kind, c.step, c.attempt, env)
    return Sent(out.messages[n - len(out.commands)], env.id, "message", None, None, env)


def _names(classes: Sequence[type[Event]]) -> str:
    return " | ".join(c.__name__ for c in classes) or "nothing"
