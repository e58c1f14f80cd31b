"""Testing a saga in-process, given/when/then, on a virtual clock: no broker, no store, no
real time.

:class:`SagaTest` drives the saga's state machine (:class:`~eventflow.sagas.machine.Machine`)
the way the runtime does, one input at a time::

    t = SagaTest(OrderSaga)
    await t.given(OrderPlaced(order_id="o-1", sku="s", qty=1, amount=100))
    await t.when_reply(StockReserved(order_id="o-1"))   # answers the waiting ReserveStock
    await t.when_reply(PaymentDeclined(order_id="o-1"))
    t.then_sent(ReserveStock, ChargePayment, ReleaseStock).then_status("compensated")
    await t.advance(30)                                  # fires every timer due, in order

Between inputs the saga is saved and loaded back as the runtime does (its fields through
``model_dump(mode="json")``, JSON and ``model_validate``; its control state through
``Control.as_dict``/``from_dict``), so a test fails on state that would not survive a
reload. Input events and the commands sent go through the envelope path of the runtime
(``envelope_for``, the wire bytes, decoding), so an event that could not be sent fails here
too. Timers are kept as the store keeps them (one setting per name, the latest wins) and
fire when :meth:`SagaTest.advance` moves the clock past them, earliest first.

Command ids are the runtime's: derived from the saga, the step and the attempt, and from
the clock at the start (fixed by default), so the same inputs give the same ids.

A test that asks for something the saga cannot do (a reply while nothing waits, a timer
that is not set) raises :class:`SagaTestError` saying what the saga waits for; the
``then_*`` checks raise ``AssertionError`` with what the saga did instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

import orjson
from pydantic import ValidationError

from ..adapters.memory import MemoryStore
from ..envelope import Envelope, hashed_id
from ..events import Event, EventRegistry, envelope_for
from ..sagas.definition import Saga, SagaDefinition
from ..sagas.machine import ENDED, FAILED, STATUSES, Control, Machine, Outcome, Transition
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


@dataclass
class _Timer:
    due: float
    token: str
    order: int


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
        self._state: bytes | None = None
        self._control: bytes | None = None
        self._history: list[bytes] = []
        self._timers: dict[str, _Timer] = {}
        self._superseded: dict[str, list[str]] = {}  # timer name -> old tokens, newest last
        self._timer_order = 0
        self._inputs = 0
        self._sent: list[Sent] = []
        self._applied: list[Applied] = []
        self._inputs_by_type = {c.event_type: c for c in self.definition.input_types()}
        # The runtime's own path from an outcome to envelopes (it reads no store).
        self._envelopes = Sagas(MemoryStore(), _DECODER, _SOURCE)

    # -- what the test sees ---------------------------------------------------------------

    @property
    def started(self) -> bool:
        """True once :meth:`given` started the saga."""
        return self._state is not None

    @property
    def saga(self) -> S:
        """The saga as loaded after the last input: its fields, ``status``, ``reason``,
        ``key``, ``id`` and ``history`` (a fresh copy each time)."""
        self._require_started("read .saga")
        saga, _control = self._load()
        saga._meta["history"] = self.history
        return saga

    @property
    def status(self) -> str:
        """The saga's status (``running``, ``completed``, ``compensating``, ...)."""
        return self._control_now().status

    @property
    def control(self) -> Control:
        """A copy of the saga's control state (where it is, what it waits for)."""
        return self._control_now()

    @property
    def history(self) -> list[Transition]:
        """Every transition so far, oldest first (as the saga's stream holds them)."""
        return [Transition.from_dict(orjson.loads(raw)) for raw in self._history]

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
        return {name: t.due - self._now for name, t in self._ordered_timers()}

    @property
    def waits_for(self) -> str:
        """What the saga waits for, in words."""
        if not self.started:
            return (
                f"the saga has not started: start it with "
                f".given({self.definition.start.__name__}(...))"
            )
        c = self._control_now()
        if c.status in ENDED:
            return f"the saga is {c.status} and waits for nothing"
        if c.status == FAILED:
            return (
                f"the saga is failed ({c.reason}) and waits for a person: "
                ".retry(by=...) issues the step again, .skip(by=...) goes on past it"
            )
        w = c.waiting
        if w is None:
            return "nothing"
        s = self.definition.step(w["step"])
        timer = self._timers.get(f"{'retry' if w['kind'] == 'retry' else 'step'}:{s.name}")
        due = "" if timer is None else f", due in {timer.due - self._now:g}s"
        if w["kind"] == "retry":
            attempt = c.attempts.get(s.name, 1) + 1
            return f"step {s.name} waits for its attempt {attempt}{due}: call .advance(...)"
        if w["kind"] == "undo":
            assert s.compensation is not None
            return (
                f"compensation {s.compensation.name} of step {s.name} waits for "
                f"{_names(s.compensation.reply)} (command {w['command_id']}{due})"
            )
        return (
            f"step {s.name} waits for {_names((*s.reply, *s.reject))} "
            f"(command {w['command_id']}{due})"
        )

    # -- inputs ---------------------------------------------------------------------------

    async def given(self, event: Event, *, key: str | None = None) -> Applied:
        """Start the saga with its start event (``key``: the message key, used when the
        event's key field is empty)."""
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
        key = _key_of(self.definition, event, key)
        if key is None:
            raise SagaTestError(
                f"{type(event).__name__}.{self.definition.key} is empty: give the saga's "
                "key there or as .given(event, key=...)"
            )
        env, decoded = self._input(event, key, correlation_id=None, causation_id=None)
        saga = self.saga_class()
        machine = Machine(saga, Control(key=key), self._now)
        await machine.start(decoded, env.id, env.correlation_id)
        return self._save(f"start {type(event).__name__}", env.id, saga, machine, env)

    async def when(self, event: Event, *, causation_id: str | None = None) -> Applied:
        """Any input event for the saga's key (a reply, a rejection, an abort event, a
        second start event), as the runtime would hand it over. ``causation_id``: the
        command it answers (None: a foreign producer's message, matched by type)."""
        self._require_started(f"send {type(event).__name__}")
        c = self._control_now()
        if _key_of(self.definition, event, c.key) != c.key:
            raise SagaTestError(
                f"{type(event).__name__}.{self.definition.key} is "
                f"{getattr(event, self.definition.key)!r}: it is for another saga than "
                f"this one ({c.key!r})"
            )
        env, decoded = self._input(
            event, c.key, correlation_id=c.correlation_id, causation_id=causation_id
        )
        saga, control = self._load()
        machine = Machine(saga, control, self._now)
        if event.event_type == self.definition.start.event_type:
            machine.ignored(env.id, f"a second {env.type} for {c.key}: starts nothing")
        else:
            await machine.message(decoded, env.id, env.causation_id)
        return self._save(f"message {type(event).__name__}", env.id, saga, machine, env)

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
        if c.status in (*ENDED, FAILED) or w is None or w["kind"] == "retry":
            raise SagaTestError(
                f"{what} replies to nothing: {self.waits_for}. To send it anyway (a late or "
                "stray reply), use .when(event) or .when_reply(event, to=<a Sent>)"
            )
        s = self.definition.step(w["step"])
        if w["kind"] == "undo":
            assert s.compensation is not None
            takes, answering = s.compensation.reply, f"compensation {s.compensation.name}"
        else:
            takes, answering = (*s.reply, *s.reject), f"step {s.name}"
        if all(event.event_type != cls.event_type for cls in takes):
            raise SagaTestError(
                f"{what} does not answer {answering}, which waits for {_names(takes)}; "
                "to send it anyway, use .when(event)"
            )
        return await self.when(event, causation_id=w["command_id"])

    async def advance(self, seconds: float) -> list[Applied]:
        """Move the virtual clock ``seconds`` on, firing every timer due on the way (step
        deadlines, retry backoffs, named timers) at its due time, earliest first; timers
        that firing sets are fired too when due within the span."""
        if seconds < 0:
            raise SagaTestError(f"advance({seconds!r}): the clock only goes forward")
        self._require_started("advance the clock")
        target = self._now + seconds
        fired: list[Applied] = []
        at_once = 0  # firings without the clock moving
        while True:
            due = [(name, t) for name, t in self._ordered_timers() if t.due <= target]
            if not due:
                self._now = target
                return fired
            name, timer = due[0]
            at_once = at_once + 1 if timer.due <= self._now else 1
            if at_once > _MAX_AT_ONCE:
                raise SagaTestError(
                    f"{_MAX_AT_ONCE} timers fired at one instant ({self.elapsed:g}s in), the "
                    f"last {name}: a timer keeps setting itself due at once"
                )
            self._now = max(self._now, timer.due)
            fired.append(await self._fire(name, timer.token))

    async def elapse(self, timer: str) -> list[Applied]:
        """Move the clock to when ``timer`` is due and fire it (and every timer due before
        it), e.g. ``await t.elapse("step:ship")``."""
        self._require_started(f"elapse {timer}")
        current = self._timers.get(timer)
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
        return await self._fire(timer, old.pop())

    async def retry(self, *, by: str | None = None) -> Applied:
        """``eventflow sagas retry``: issue the failed step (or compensation) again under a
        new attempt (on a saga that is not failed it is recorded as ignored)."""
        return await self._person(f"retry by {by}", lambda m: m.retry(by, None))

    async def skip(self, *, by: str | None = None) -> Applied:
        """``eventflow sagas skip``: a person handled the failed step by hand; go on."""
        return await self._person(f"skip by {by}", lambda m: m.skip(by, None))

    async def abort(self, *, by: str | None = None, reason: str = "aborted") -> Applied:
        """``eventflow sagas abort``: compensate what was done (ignored after the pivot)."""
        return await self._person(f"abort by {by}", lambda m: m.abort(reason, None, by))

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
        if w is None or w["step"] != step or w["kind"] != kind:
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

    # -- the machinery --------------------------------------------------------------------

    def _require_started(self, what: str) -> None:
        if not self.started:
            raise SagaTestError(f"cannot {what}: {self.waits_for}")

    def _control_now(self) -> Control:
        if self._control is None:
            raise SagaTestError(self.waits_for)
        return Control.from_dict(orjson.loads(self._control))

    def _load(self) -> tuple[S, Control]:
        """The saga and its control state as the runtime loads them."""
        assert self._state is not None
        saga = self.saga_class.model_validate(orjson.loads(self._state))
        control = self._control_now()
        saga._meta.update(key=control.key, status=control.status, reason=control.reason)
        return saga, control

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

    async def _fire(self, name: str, token: str) -> Applied:
        """A timer firing, as the runtime's timer loop applies it."""
        saga, control = self._load()
        message_id = hashed_id(0, "saga-timer", saga.id, name, token)
        machine = Machine(saga, control, self._now)
        outcome = await machine.timer(name, token, message_id)
        current = self._timers.get(name)
        if not outcome.changed and current is not None and current.token == token:
            del self._timers[name]  # the runtime drops the row that fired for nothing
        return self._save(f"timer {name}", message_id, saga, machine, None)

    async def _person(self, what: str, act: Any) -> Applied:
        self._require_started(what)
        saga, control = self._load()
        machine = Machine(saga, control, self._now)
        await act(machine)
        return self._save(what, None, saga, machine, None)

    def _save(
        self,
        what: str,
        message_id: str | None,
        saga: S,
        machine: Machine,
        cause: Envelope | None,
    ) -> Applied:
        """Keep the outcome as the runtime's store would: the state (checked to read back
        the same), the history, the timers; and what was sent."""
        out, control = machine.out, machine.control
        state = self._checked_state(saga)
        sent = self._sent_of(out, control, cause)
        self._state = state
        self._control = orjson.dumps(control.as_dict())
        self._history.extend(orjson.dumps(t.as_dict()) for t in out.transitions)
        for name in out.timers_cancelled:
            old = self._timers.pop(name, None)
            if old is not None:
                self._superseded.setdefault(name, []).append(old.token)
        for name, (due, token) in out.timers_set.items():
            old = self._timers.get(name)
            if old is not None and old.token != token:
                self._superseded.setdefault(name, []).append(old.token)
            self._timer_order += 1
            self._timers[name] = _Timer(due, token, self._timer_order)
        self._sent.extend(sent)
        applied = Applied(
            what,
            message_id,
            tuple(out.transitions),
            tuple(sent),
            {name: due - self._now for name, (due, _) in out.timers_set.items()},
            frozenset(out.timers_cancelled),
        )
        self._applied.append(applied)
        return applied

    def _checked_state(self, saga: S) -> bytes:
        """The saga's fields as saved, after checking they load back equal."""
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
        return raw

    def _sent_of(self, out: Outcome, control: Control, cause: Envelope | None) -> list[Sent]:
        """What an outcome sends, with the envelopes the runtime would publish."""
        pairs = self._envelopes.commands(self.definition, control, out, cause)
        issuing = [t for t in out.transitions if t.kind in ("command-sent", "compensation-sent")]
        assert len(issuing) == len(out.commands), "a command without its transition"
        found: list[Sent] = []
        for n, (_topic, env) in enumerate(pairs):
            if n < len(out.commands):
                event, _id = out.commands[n]
                t = issuing[n]
                undo = t.kind == "compensation-sent"
                attempt = control.attempts.get(f"undo:{t.step}" if undo else str(t.step))
                kind = "compensation" if undo else "command"
                found.append(Sent(event, env.id, kind, t.step, attempt, env))
            else:
                event = out.messages[n - len(out.commands)]
                found.append(Sent(event, env.id, "message", None, None, env))
        return found

    def _ordered_timers(self) -> list[tuple[str, _Timer]]:
        return sorted(self._timers.items(), key=lambda item: (item[1].due, item[1].order))

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


def _key_of(definition: SagaDefinition, event: Event, message_key: str | None) -> str | None:
    """The saga key the runtime reads from an input: its key field, else the message key."""
    value = getattr(event, definition.key, None)
    if value is not None and value != "":
        return str(value)
    return message_key


def _names(classes: Sequence[type[Event]]) -> str:
    return " | ".join(c.__name__ for c in classes) or "nothing"
