"""How a saga goes on after an input: the half of the state machine every input shares.

:meth:`Progress._advance` issues what comes next (the next step by name, or the next
compensation, newest first) until the saga waits for something or ends; the state changes
(done, compensating, failed, ended) and the records (transitions, commands, timers) are
here too. :class:`~eventflow.sagas.machine.Machine` adds the inputs.

A saga method is called by :meth:`Progress._call`, which returns once the method has
returned, with the abort it asked for (if any) for its caller to apply; the timers it set
or cancelled are applied there. Nothing re-enters ``_advance``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..envelope import hashed_id
from ..events import Event
from .control import (
    ENDED,
    Action,
    Control,
    Issued,
    Phase,
    Resume,
    Status,
    Timer,
    TimerKind,
    Wait,
    Waiting,
    timer_key,
    timer_row,
)
from .definition import Abort, CancelTimer, Saga, SagaDefinition, SetTimer, Step
from .outcome import Command, Outcome, Transition

__all__ = ["Progress", "refusal"]


class Progress:
    """One saga, its control state and the outcome of the input being applied."""

    def __init__(self, saga: Saga, control: Control, now: float) -> None:
        self.saga = saga
        self.definition: SagaDefinition = type(saga).definition
        self.control = control
        self.now = now
        self.out = Outcome()
        self._message_id: str | None = None
        self._rerun: str | None = None  # a step to send again (a backoff, a retry)

    # -- state changes -----------------------------------------------------------------------

    def _abort(self, reason: str, by: str | None) -> None:
        """Stop going forward. A step whose command is out is compensated after its
        outcome (its reply, rejection or deadline), so its waiting stays."""
        why = refusal(self.control, "abort")
        if why is not None:
            self._ignore(f"abort ({reason}) of a saga that is {self.control.status}: {why}")
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
        asked = self.saga._effects  # filled by the method (set_timer, abort ...)
        asked.clear()
        value = fn(*args)
        if inspect.isawaitable(value):
            value = await value
        effects = asked.copy()
        asked.clear()
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
        key, row = timer_key(kind, name), timer_row(kind, name)
        for old in [t for t in c.timers.values() if t.row == row and t.key != key]:
            del c.timers[old.key]  # its row is this one's now
        token = f"{c.seq}:{key}"
        due = self.now + seconds
        c.timers[key] = Timer(kind, name, due, token, row)
        self.out.timers_set[row] = (due, token)
        self.out.timers_cancelled.discard(row)
        if kind is TimerKind.NAMED:
            self._note("timer-set", None, f"{name} in {seconds:g}s")

    def _cancel(self, kind: TimerKind, name: str) -> None:
        t = self.control.timers.pop(timer_key(kind, name), None)
        if t is not None:
            self.out.timers_cancelled.add(t.row)
            self.out.timers_set.pop(t.row, None)
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


def refusal(c: Control, action: str) -> str | None:
    """Why a person's ``action`` (``retry``, ``skip`` or ``abort``; an abort event or
    ``self.abort`` too) would change nothing for the saga in ``c``, or None if it acts:
    the rule the machine applies, which the command line checks before it writes."""
    if action in ("retry", "skip"):
        if c.status is Status.FAILED and c.resume is not None:
            return None
        return f"only a failed saga can be {'retried' if action == 'retry' else 'skipped'}"
    if c.status is Status.PENDING:
        return "it has not started (inputs are kept for it until its start event comes)"
    if c.status in ENDED:
        return "nothing to abort"
    if c.status is Status.FAILED:
        return "a failed saga is retried or skipped (sagas retry, sagas skip), not aborted"
    if c.phase is Phase.COMPENSATING:
        return "it is already compensating"
    if c.pivoted:
        return (
            "it is past its pivot step and only goes forward; a failed step can be retried "
            "or skipped"
        )
    return None
