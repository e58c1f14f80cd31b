"""The saga state machine: one input (a start event, a reply, a timer, an abort, a person's
retry or skip) applied to a loaded saga gives transitions, commands and timer changes.

It reads no clock and touches no store: the caller passes ``now`` (Unix seconds) and saves
the :class:`Outcome`. The runtime and the test kit (:mod:`eventflow.testing.sagas`) drive it
through the same handling code (:mod:`eventflow.sagas.handling`).

How a reader checks it: every input method changes the :class:`~.control.Control`, then
calls :meth:`Machine._advance` once, which issues what comes next until the saga waits or
ends. A saga method (a step, a compensation, ``on_reply``, ``started``, a timer method)
is called by :meth:`Machine._call`, which returns its result once it has returned and
takes the effects it asked for (timers set or cancelled: applied; an abort: returned to
the caller, which changes the state); nothing re-enters ``_advance``. Where the saga is
goes by step name (``Control.at``), so a deploy that adds, removes or reorders steps
leaves a running saga at its step; one that removes the step a saga is at fails it,
saying so.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..envelope import hashed_id
from ..events import Event
from .control import (
    ENDED,
    STATUSES,
    Action,
    Control,
    Issued,
    Kept,
    Phase,
    Resume,
    Status,
    Timer,
    TimerKind,
    Wait,
    Waiting,
    timer_key,
)
from .definition import Abort, CancelTimer, Saga, SagaDefinition, SetTimer, Step

__all__ = ["STATUSES", "Command", "Control", "Early", "Machine", "Outcome", "Transition"]


@dataclass(frozen=True)
class Transition:
    """One entry of a saga's history."""

    kind: str
    step: str | None
    at: datetime
    message_id: str | None
    detail: str = ""
    by: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form saved in the saga's stream."""
        return {
            "kind": self.kind,
            "step": self.step,
            "at": self.at.isoformat(),
            "message_id": self.message_id,
            "detail": self.detail,
            "by": self.by,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Transition:
        """Read back :meth:`as_dict`."""
        return cls(
            data["kind"],
            data.get("step"),
            datetime.fromisoformat(data["at"]),
            data.get("message_id"),
            data.get("detail", ""),
            data.get("by"),
        )


@dataclass(frozen=True)
class Command:
    """A command (or compensation) an input sends, with the id the machine gave it."""

    event: Event
    id: str
    step: str
    action: Action
    attempt: int
    compensates: str | None = None
    """For a compensation: the id of the command it undoes (None for a local step's)."""


@dataclass(frozen=True)
class Early:
    """An input kept before the start, decoded, to apply right after it."""

    event: Event
    message_id: str
    causation_id: str | None


@dataclass
class Outcome:
    """What one input did: to save, send and schedule."""

    transitions: list[Transition] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    messages: list[Event] = field(default_factory=list)  # plain events from timer methods
    timers_set: dict[str, tuple[float, str]] = field(default_factory=dict)  # key: (due, token)
    timers_cancelled: set[str] = field(default_factory=set)

    @property
    def changed(self) -> bool:
        """False when the input changed nothing but the history (ignored)."""
        return any(t.kind != "ignored" for t in self.transitions)


class Machine:
    """Applies inputs to one saga; each input method returns the :class:`Outcome`."""

    def __init__(self, saga: Saga, control: Control, now: float) -> None:
        self.saga = saga
        self.definition: SagaDefinition = type(saga).definition
        self.control = control
        self.now = now
        self.out = Outcome()
        self._message_id: str | None = None
        self._rerun: str | None = None  # a step to send again (a backoff, a retry)

    # -- inputs --------------------------------------------------------------------------

    async def start(
        self,
        event: Event,
        message_id: str,
        correlation_id: str,
        early: Sequence[Early] = (),
    ) -> Outcome:
        """The start event of a new saga, then the inputs kept before it (``early``, in
        arrival order). An abort among them ends the saga at the start, with nothing done."""
        self._begin(message_id)
        c = self.control
        c.origin_ms = c.origin_ms or int(self.now * 1000)
        c.correlation_id = correlation_id
        c.status, c.kept = Status.RUNNING, []
        self._note("started")
        started = getattr(self.saga, "started", None)
        if started is not None:
            await self._obey(await self._call(started, event))
        if not any(self.definition.is_abort(e.event) for e in early):
            await self._advance()
        for e in early:
            await self.message(e.event, e.message_id, e.causation_id)
        return self.out

    def keep(self, envelope: dict[str, Any], message_id: str, event_type: str) -> Outcome:
        """An input for a saga that has not started: kept, applied after the start."""
        self._begin(message_id)
        c = self.control
        if any(k.id == message_id for k in c.kept):
            return self._ignore(f"{event_type} kept already")
        c.status = Status.PENDING
        c.origin_ms = c.origin_ms or int(self.now * 1000)
        c.kept.append(Kept(message_id, envelope))
        self._note("kept", None, f"{event_type} before the start: applied after it")
        return self.out

    def ignored(self, message_id: str | None, detail: str, step: str | None = None) -> Outcome:
        """An input that changes nothing, recorded in the history."""
        self._begin(message_id)
        return self._ignore(detail, step)

    async def message(self, event: Event, message_id: str, causation_id: str | None) -> Outcome:
        """A reply, a rejection or an abort event for this saga's key."""
        self._begin(message_id)
        c, etype = self.control, event.event_type
        if self.definition.is_abort(event):
            self._abort(f"aborted by {etype}", None)
            await self._advance()
            return self.out
        if c.status in ENDED or c.status is Status.FAILED:
            return self._ignore(f"{etype} for a saga already {c.status}")
        w = c.waiting
        if w is None:
            return self._ignore(f"{etype} while no step waits for a reply")
        s = self.definition.find(w.step)
        if s is None:
            return self._removed(w.step)
        answers = c.issued_as(causation_id)
        if w.wait is Wait.UNDO:
            return await self._undo_reply(s, event, answers)
        earlier = answers if answers is not None and answers.id != w.command_id else None
        success = _is(event, s.reply)
        if earlier is not None and not (success and self._late_success(s, earlier)):
            return self._ignore(f"{etype} answers an earlier command ({earlier.id})", s.name)
        if success:
            late = "" if earlier is None else f" (to attempt {earlier.attempt})"
            await self._replied(s, event, etype + late)
        elif _is(event, s.reject):
            if w.wait is Wait.BACKOFF:
                return self._ignore(f"{etype} while step {s.name} waits for its backoff", s.name)
            self._cancel(TimerKind.DEADLINE, s.name)
            c.waiting = None
            self._note("rejected", s.name, etype)
            self._step_failed(s, f"{s.name} rejected ({etype})", compensate_it=False)
        else:
            return self._ignore(f"{etype} does not answer step {s.name}", s.name)
        await self._advance()
        return self.out

    async def timer(self, name: str, token: str, message_id: str) -> Outcome:
        """A timer fired: ``name`` is its key in the timer rows (:func:`.control.timer_key`),
        ``token`` the setting it was fired for. This is what the timer loop calls, in the
        store transaction of the firing; when it raises (saga code did), roll that
        transaction back and apply :meth:`timer_failed` in a new one."""
        self._begin(message_id)
        t = self.control.timers.get(name)
        if t is None or t.token != token:
            return self._ignore(f"timer {name} fired after it was cancelled or rescheduled")
        await self._fired(t)
        await self._advance()
        return self.out

    def timer_failed(self, name: str, token: str, message_id: str, error: str) -> Outcome:
        """The firing of timer ``name`` raised ``error`` (saga code did): the saga is
        ``failed`` there, and ``sagas retry`` fires the timer again. Nothing else changes
        (the firing's own transaction was rolled back)."""
        self._begin(message_id)
        c = self.control
        t = c.timers.get(name)
        if t is None or t.token != token:
            return self._ignore(f"timer {name} fired after it was cancelled or rescheduled")
        del c.timers[name]
        self.out.timers_cancelled.add(name)
        step = t.name if t.kind is not TimerKind.NAMED else None
        c.resume = Resume(step, None, c.reason, t, c.status)
        c.status = Status.FAILED
        c.reason = f"timer {name} raised {error}"
        self._note("failed", step, c.reason)
        return self.out

    async def abort(self, reason: str, message_id: str | None, by: str | None) -> Outcome:
        """Abort from outside (the CLI): compensate what was done."""
        self._begin(message_id)
        self._abort(reason, by)
        await self._advance()
        return self.out

    async def retry(self, by: str | None, message_id: str | None) -> Outcome:
        """A person resumes a failed saga: the failed step (or compensation) is issued again
        under a new attempt (a new command id), or the timer that raised fires again."""
        self._begin(message_id)
        c, r = self.control, self.control.resume
        if c.status is not Status.FAILED or r is None:
            return self._ignore(f"retry asked of a saga that is {c.status}")
        c.resume, c.reason = None, r.reason
        if r.timer is not None:
            self._note("retried", r.step, f"timer {r.timer.key} again", by)
            c.status = r.status or Status.RUNNING
            await self._fired(r.timer)
        elif r.action is Action.UNDO:
            assert r.step is not None
            self._note("retried", r.step, "undo again", by)
            c.undo_attempts[r.step] = c.undo_attempts.get(r.step, 1) + 1
            c.undo = [r.step, *(c.undo or [])]
            c.status, c.phase = Status.COMPENSATING, Phase.COMPENSATING
        else:
            assert r.step is not None
            self._note("retried", r.step, "do again", by)
            c.attempts[r.step] = c.attempts.get(r.step, 1) + 1
            c.status, c.phase = Status.RUNNING, Phase.FORWARD
            self._rerun = r.step
        await self._advance()
        return self.out

    async def skip(self, by: str | None, message_id: str | None) -> Outcome:
        """A person handled the failed step (or compensation) by hand: go on past it. For a
        timer that raised: it is dropped, not fired."""
        self._begin(message_id)
        c, r = self.control, self.control.resume
        if c.status is not Status.FAILED or r is None:
            return self._ignore(f"skip asked of a saga that is {c.status}")
        c.resume, c.reason = None, r.reason
        if r.timer is not None:
            self._note("skipped", r.step, f"timer {r.timer.key} dropped", by)
            c.status = r.status or Status.RUNNING
        elif r.action is Action.UNDO:
            self._note("skipped", r.step, "undo handled by hand", by)
            c.status, c.phase = Status.COMPENSATING, Phase.COMPENSATING
        else:
            assert r.step is not None
            self._note("skipped", r.step, "do handled by hand", by)
            c.status, c.phase = Status.RUNNING, Phase.FORWARD
            s = self.definition.find(r.step)
            if s is not None:
                self._step_done(s)
            else:  # removed by a deploy: go on from the first step not done
                c.done.append(r.step)
                c.at = None
        await self._advance()
        return self.out

    # -- what an input does ------------------------------------------------------------------

    async def _fired(self, t: Timer) -> None:
        """A current timer fires: its setting goes, then its kind decides."""
        c = self.control
        c.timers.pop(t.key, None)
        self.out.timers_cancelled.add(t.key)  # its row goes with this transition
        w = c.waiting
        if t.kind is TimerKind.NAMED:
            if c.status in ENDED:
                self._ignore(f"timer {t.key} for a saga already {c.status}")
                return
            self._note("timer-fired", None, t.name)
            method = getattr(self.saga, self.definition.timers[t.name])
            result = await self._call(method)
            if isinstance(result.value, Event):
                self.out.messages.append(result.value)
            elif result.value is not None:
                raise TypeError(
                    f"saga {self.definition.name}: {method.__name__} returned "
                    f"{result.value!r}; a timer method returns an event to publish (an Event "
                    "instance) or None"
                )
            await self._obey(result)
            return
        backoff = t.kind is TimerKind.BACKOFF
        if w is None or w.step != t.name or (w.wait is Wait.BACKOFF) is not backoff:
            self._ignore(f"timer {t.key} for a step no longer waiting", t.name)
            return
        s = self.definition.find(t.name)
        if s is None:
            self._removed(t.name)
            return
        c.waiting = None
        if t.kind is TimerKind.BACKOFF:
            c.attempts[s.name] = c.attempts.get(s.name, 1) + 1
            self._rerun = s.name
        elif w.wait is Wait.UNDO:
            assert s.compensation is not None
            self._note("timed-out", s.name, f"{s.compensation.name} got no reply")
            self._fail(
                f"compensation {s.compensation.name} got no reply within {s.compensation.timeout}s",
                Resume(s.name, Action.UNDO, c.reason),
            )
        else:
            self._note("timed-out", s.name, f"no reply within {s.timeout}s")
            self._step_failed(s, f"{s.name} timed out", compensate_it=True)

    async def _replied(self, s: Step, event: Event, detail: str) -> None:
        """A step succeeded: done before its ``on_reply`` runs (an abort from there
        compensates it too)."""
        c = self.control
        self._cancel(TimerKind.DEADLINE, s.name)
        self._cancel(TimerKind.BACKOFF, s.name)
        c.waiting = None
        self._note("replied", s.name, detail)
        self._step_done(s)
        if s.reply_handler is not None:
            await self._obey(await self._call(s.reply_handler, self.saga, event))

    def _late_success(self, s: Step, answered: Issued) -> bool:
        """Past the pivot, a success reply to an earlier attempt of the step waiting (or
        backing off) is its success."""
        return self.control.pivoted and answered.step == s.name and answered.action is Action.DO

    async def _undo_reply(self, s: Step, event: Event, answers: Issued | None) -> Outcome:
        c, etype = self.control, event.event_type
        w = c.waiting
        assert w is not None and s.compensation is not None
        if answers is not None and answers.id != w.command_id:
            return self._ignore(f"{etype} answers an earlier command ({answers.id})", s.name)
        if not _is(event, s.compensation.reply):
            return self._ignore(f"{etype} is not the reply of {s.compensation.name}", s.name)
        self._cancel(TimerKind.DEADLINE, s.name)
        c.waiting = None
        self._note("compensated", s.name, etype)
        await self._advance()
        return self.out

    def _step_failed(self, s: Step, reason: str, *, compensate_it: bool) -> None:
        """A forward step was rejected or timed out: past the pivot, back off and send it
        again; else compensate (a timed-out step too: its command may have taken effect).
        When an abort waits for this step's outcome, compensating goes on."""
        c = self.control
        if c.pivoted and c.phase is Phase.FORWARD:
            attempt = c.attempts.get(s.name, 1)
            if attempt >= s.retry:
                self._fail(
                    f"{reason}; out of its {s.retry} attempts past the pivot",
                    Resume(s.name, Action.DO),
                )
                return
            delay = s.retry_delay * 2 ** (attempt - 1)
            last = c.last_issued(s.name, Action.DO)
            c.waiting = Waiting(s.name, Wait.BACKOFF, last.id if last else None)
            self._set(TimerKind.BACKOFF, s.name, delay)
            self._note("retry-scheduled", s.name, f"attempt {attempt + 1} in {delay:g}s")
            return
        if compensate_it:
            c.done.append(s.name)
        if c.phase is Phase.FORWARD:  # else an abort waited for this outcome
            self._compensate(reason)

    def _abort(self, reason: str, by: str | None) -> None:
        """Stop going forward. A step whose command is out is compensated after its
        outcome (its reply, rejection or deadline), so its waiting stays."""
        c = self.control
        if c.status in ENDED or c.phase is Phase.COMPENSATING:
            self._ignore(f"abort ({reason}) of a saga already {c.status}")
            return
        if c.status is Status.FAILED:
            self._ignore(f"abort ({reason}) of a failed saga: it needs sagas retry or skip")
            return
        if c.pivoted:
            self._ignore(f"abort ({reason}) after the pivot: the saga only goes forward")
            return
        self._note("aborted", None, reason, by)
        self._compensate(reason)

    def _compensate(self, reason: str) -> None:
        c = self.control
        c.status, c.phase, c.reason, c.undo = (
            Status.COMPENSATING,
            Phase.COMPENSATING,
            reason,
            None,
        )
        self._note("compensating", None, reason)

    def _fail(self, reason: str, resume: Resume) -> None:
        c = self.control
        c.status, c.reason, c.resume, c.waiting = Status.FAILED, reason, resume, None
        self._note("failed", resume.step, reason)

    def _removed(self, step: str) -> Outcome:
        """The saga is at a step its definition no longer has: failed, saying so."""
        c = self.control
        action = Action.UNDO if c.phase is Phase.COMPENSATING else Action.DO
        for kind in TimerKind:
            if kind is not TimerKind.NAMED:
                self._cancel(kind, step)
        self._fail(
            f"step {step} is not in saga {self.definition.name}'s definition any more (a "
            "deploy removed it): handle it by hand and `eventflow sagas skip`, or deploy it "
            "back and `eventflow sagas retry`",
            Resume(step, action, c.reason),
        )
        return self.out

    def _end(self, status: Status) -> None:
        c = self.control
        c.status, c.phase, c.waiting = status, Phase.ENDED, None
        for t in list(c.timers.values()):
            self._cancel(t.kind, t.name)
        self._note(status.value, None, c.reason or "")

    def _step_done(self, s: Step) -> None:
        c = self.control
        c.done.append(s.name)
        c.at = s.name
        c.pivoted = c.pivoted or s.pivot

    # -- going on --------------------------------------------------------------------------

    async def _advance(self) -> None:
        """Issue what comes next until the saga waits for something or ends."""
        c = self.control
        while c.status in (Status.RUNNING, Status.COMPENSATING) and c.waiting is None:
            if c.phase is Phase.FORWARD:
                name, self._rerun = self._rerun, None
                try:
                    s = self.definition.find(name) if name else self.definition.after(c.at, c.done)
                except KeyError:
                    self._removed(str(c.at))
                    return
                if s is None:
                    if name is not None:
                        self._removed(name)
                    else:
                        self._end(Status.COMPLETED)
                    return
                await self._forward(s)
            else:
                await self._backward()

    async def _forward(self, s: Step) -> None:
        """Run the step ``s``: send its command and wait for its answer (or be done)."""
        c = self.control
        c.at = s.name
        result = await self._call(s.fn, self.saga)
        if result.abort is not None:
            self._abort(result.abort, None)  # its command is not sent
            return
        command = _command(self.definition, s.fn, result.value)
        if command is None:
            self._note("step-done", s.name, "local step")
            self._step_done(s)
            return
        attempt = c.attempts.setdefault(s.name, 1)
        sent = self._send(command, s.name, Action.DO, attempt, None)
        if not s.reply:
            self._step_done(s)  # nothing answers it: done once sent
            return
        c.waiting = Waiting(s.name, Wait.REPLY, sent)
        if s.timeout is not None:
            self._set(TimerKind.DEADLINE, s.name, s.timeout)

    async def _backward(self) -> None:
        """Issue the next compensation, newest step first."""
        c = self.control
        if c.undo is None:  # chosen once the step in flight (if any) has its outcome
            c.undo = [n for n in reversed(c.done) if self._compensable(n)]
        if not c.undo:
            self._end(Status.COMPENSATED)
            return
        name = c.undo.pop(0)
        s = self.definition.find(name)
        if s is None or s.compensation is None:
            c.undo.insert(0, name)
            self._removed(name)
            return
        comp = s.compensation
        result = await self._call(comp.fn, self.saga)
        if result.abort is not None:
            self._abort(result.abort, None)  # recorded: it compensates already
        command = _command(self.definition, comp.fn, result.value)
        if command is None:
            self._note("compensated", name, "local compensation")
            return
        attempt = c.undo_attempts.setdefault(name, 1)
        undoes = c.last_issued(name, Action.DO)
        sent = self._send(command, name, Action.UNDO, attempt, undoes.id if undoes else None)
        if comp.reply:
            c.waiting = Waiting(name, Wait.UNDO, sent)
            if comp.timeout is not None:
                self._set(TimerKind.DEADLINE, name, comp.timeout)

    def _compensable(self, name: str) -> bool:
        s = self.definition.find(name)
        return s is None or s.compensation is not None  # a removed step fails there

    # -- saga methods and their effects ------------------------------------------------------

    async def _call(self, fn: Any, *args: Any) -> _Result:
        """Call a saga method (sync or async) and take what it asked for once it has
        returned: timers are set or cancelled here, an abort is returned for the caller."""
        self.saga._effects = []
        value = fn(*args)
        if inspect.isawaitable(value):
            value = await value
        effects, self.saga._effects = self.saga._effects, []
        abort: str | None = None
        for effect in effects:
            if isinstance(effect, SetTimer):
                self._set(TimerKind.NAMED, effect.name, effect.seconds)
            elif isinstance(effect, CancelTimer):
                self._cancel(TimerKind.NAMED, effect.name)
            elif isinstance(effect, Abort) and abort is None:
                abort = effect.reason
        return _Result(value, abort)

    async def _obey(self, result: _Result) -> None:
        """Apply the abort a method asked for (one whose result is not a command)."""
        if result.abort is not None:
            self._abort(result.abort, None)

    # -- records ---------------------------------------------------------------------------

    def _begin(self, message_id: str | None) -> None:
        self._message_id = message_id
        self.control.seq += 1

    def _note(
        self, kind: str, step: str | None = None, detail: str = "", by: str | None = None
    ) -> None:
        at = datetime.fromtimestamp(self.now, UTC)
        self.out.transitions.append(Transition(kind, step, at, self._message_id, detail, by))

    def _ignore(self, detail: str, step: str | None = None) -> Outcome:
        self._note("ignored", step, detail)
        return self.out

    def _send(
        self, command: Event, step: str, action: Action, attempt: int, undoes: str | None
    ) -> str:
        c = self.control
        command_id = hashed_id(
            c.origin_ms, "saga", self.definition.name, c.key, action.value, step, str(attempt)
        )
        c.issued.append(Issued(command_id, step, action, attempt))
        self.out.commands.append(Command(command, command_id, step, action, attempt, undoes))
        what = "command-sent" if action is Action.DO else "compensation-sent"
        self._note(what, step, f"{command.event_type} (attempt {attempt})")
        return command_id

    def _set(self, kind: TimerKind, name: str, seconds: float) -> None:
        c = self.control
        key = timer_key(kind, name)
        token = f"{c.seq}:{key}"
        due = self.now + seconds
        c.timers[key] = Timer(kind, name, due, token)
        self.out.timers_set[key] = (due, token)
        self.out.timers_cancelled.discard(key)
        if kind is TimerKind.NAMED:
            self._note("timer-set", None, f"{name} in {seconds:g}s")

    def _cancel(self, kind: TimerKind, name: str) -> None:
        c = self.control
        key = timer_key(kind, name)
        if c.timers.pop(key, None) is not None:
            self.out.timers_cancelled.add(key)
            self.out.timers_set.pop(key, None)
            if kind is TimerKind.NAMED:
                self._note("timer-cancelled", None, name)


@dataclass(frozen=True)
class _Result:
    """What a saga method returned, and the abort it asked for (if any)."""

    value: Any
    abort: str | None


def _command(definition: SagaDefinition, fn: Any, value: Any) -> Event | None:
    """A step's (or compensation's) result as its command; refuses anything else."""
    if value is not None and not isinstance(value, Event):
        raise TypeError(
            f"saga {definition.name}: {fn.__name__} returned {value!r}; a step returns the "
            "command (an Event instance) or None"
        )
    return value


def _is(event: Event, classes: tuple[type[Event], ...]) -> bool:
    return any(event.event_type == cls.event_type for cls in classes)
